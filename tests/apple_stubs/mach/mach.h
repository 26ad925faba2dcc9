// Stand-in for Apple's <mach/mach.h> (see objc/runtime.h): what MTLResource::setOwner uses.
#pragma once

typedef int kern_return_t;                 // a Mach call's result code
typedef unsigned int mach_port_t;          // a Mach port name
typedef mach_port_t task_id_token_t;       // a task identity token
