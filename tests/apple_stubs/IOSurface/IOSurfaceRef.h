// Stand-in for Apple's <IOSurface/IOSurfaceRef.h> (see objc/runtime.h): the surface handle that
// MTLDevice/MTLTexture accept.
#pragma once

typedef struct __IOSurface* IOSurfaceRef;   // an IOSurface (opaque)
