// Stand-in for Apple's <CoreFoundation/CoreFoundation.h> (see objc/runtime.h), as far as metal-cpp uses it.
#pragma once

#include <math.h>    // the real header includes it: metal-cpp's INFINITY comes from here
#include <stddef.h>  // likewise: metal-cpp uses plain size_t

typedef const void* CFTypeRef;    // any CoreFoundation object
typedef double CFTimeInterval;    // seconds
