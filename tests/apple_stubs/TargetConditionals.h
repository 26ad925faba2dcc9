// Stand-in for Apple's <TargetConditionals.h> (see objc/runtime.h): the build target is macOS.
#pragma once

#define TARGET_OS_OSX 1   // macOS (metal-cpp declares the macOS-only Metal API under it)
