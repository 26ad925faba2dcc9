// Stand-in for Apple's <objc/runtime.h>, only so metal-cpp type-checks on Linux
// (tests/test_metal_launcher_compiles.py). Declarations only; the launcher probe
// (tests/metal_launcher/probe.cpp) defines the functions as recorders.
#pragma once

struct objc_class;                     // an Objective-C class (opaque)
struct objc_object {                   // an Objective-C object: complete, metal-cpp's NS::Object derives from it
  struct objc_class* isa;              // its class
};
struct objc_selector;                  // a method selector (opaque)
typedef struct objc_class* Class;      // objc's Class
typedef struct objc_selector* SEL;     // objc's SEL
typedef struct objc_object Protocol;   // objc's Protocol (an object)

extern "C" {
SEL sel_registerName(const char* name);          // selector for a method name
Class objc_lookUpClass(const char* name);        // class by name, or null
Protocol* objc_getProtocol(const char* name);    // protocol by name, or null
}
