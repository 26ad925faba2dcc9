// Stand-in for Apple's <dispatch/dispatch.h> (see objc/runtime.h): the libdispatch object types
// that metal-cpp's Metal API takes (event listeners, IO queues).
#pragma once

typedef struct dispatch_queue_s* dispatch_queue_t;   // a dispatch queue
typedef struct dispatch_data_s* dispatch_data_t;     // an immutable dispatch data object
