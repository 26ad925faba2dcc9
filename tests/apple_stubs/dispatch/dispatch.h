// Stand-in for Apple's <dispatch/dispatch.h> (see objc/runtime.h): the libdispatch types that
// metal-cpp's Metal API takes, and what loading a metallib from memory calls. Object types are
// declared as Apple's header declares them for C++: classes derived from dispatch_object_s.
#pragma once

#include <stddef.h>

struct dispatch_object_s {};                                    // any dispatch object
struct dispatch_queue_s : dispatch_object_s {};                 // a dispatch queue
struct dispatch_data_s : dispatch_object_s {};                  // an immutable region of bytes
typedef struct dispatch_object_s* dispatch_object_t;
typedef struct dispatch_queue_s* dispatch_queue_t;
typedef struct dispatch_data_s* dispatch_data_t;
typedef void (^dispatch_block_t)(void);                         // a block taking and returning nothing

#define DISPATCH_DATA_DESTRUCTOR_DEFAULT NULL                   // copy the bytes, free the copy with the data

extern "C" {
// A data object over size bytes of buffer (copied with the default destructor).
dispatch_data_t dispatch_data_create(const void* buffer, size_t size, dispatch_queue_t queue, dispatch_block_t destructor);
void dispatch_release(dispatch_object_t object);                // drop a reference
}
