// Stand-in for Apple's <objc/message.h> (see objc/runtime.h): the message-send entry points that
// metal-cpp's NS::Object::sendMessage casts to the right function type before calling.
#pragma once
#include <objc/runtime.h>

extern "C" {
void objc_msgSend(void);          // send a message (metal-cpp casts it; objc declares it so too)
void objc_msgSend_fpret(void);    // x86-64: message returning a floating-point value
void objc_msgSend_stret(void);    // not arm64: message returning a large struct
}
