// Declarations only: the part of Apple's SDK that mps_src/mps/*.mm and the torch headers they
// include use, each declared as Apple's headers declare it (macOS 14 SDK), so that clang on Linux
// can type-check the Objective-C++ host (tests/mps/test_objc_check.py). Nothing here links or
// runs. Add a declaration only when a file starts using it, copying Apple's signature.
#pragma once

#ifndef __OBJC__
#error "apple_sdk_subset.h is for the Objective-C++ syntax check"
#endif

#include <stddef.h>
#include <stdint.h>

#pragma clang assume_nonnull begin

// ---- Foundation ------------------------------------------------------------------------------

typedef unsigned long NSUInteger;
typedef bool BOOL;  // arm64 macOS: OBJC_BOOL_IS_BOOL
#define YES __objc_yes  // <objc/objc.h> with objc_bool
#define NO __objc_no
#define nil nullptr  // <objc/objc.h> under C++11

@protocol NSObject
@end

__attribute__((objc_root_class))
@interface NSObject <NSObject>
+ (instancetype)alloc;
- (instancetype)init;
@end

@interface NSString : NSObject
+ (nullable instancetype)stringWithUTF8String:(const char*)nullTerminatedCString;
@property(nullable, readonly) const char* UTF8String;
@end

@interface NSArray<__covariant ObjectType> : NSObject
- (BOOL)containsObject:(ObjectType)anObject;
@end

@interface NSDictionary<__covariant KeyType, __covariant ObjectType> : NSObject
@end

@interface NSURL : NSObject
+ (NSURL*)fileURLWithPath:(NSString*)path;
@end

@interface NSError : NSObject
@property(readonly, copy) NSString* localizedDescription;
@end

// ---- dispatch (libdispatch with OS_OBJECT_USE_OBJC, as in Objective-C on macOS) ---------------

@protocol OS_dispatch_object <NSObject>
@end
@protocol OS_dispatch_queue <OS_dispatch_object>
@end
typedef NSObject<OS_dispatch_queue>* dispatch_queue_t;
typedef void (^dispatch_block_t)(void);
void dispatch_sync(dispatch_queue_t queue, __attribute__((noescape)) dispatch_block_t block);

// ---- Metal -----------------------------------------------------------------------------------

typedef struct {
  NSUInteger width, height, depth;
} MTLSize;

static inline MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
  MTLSize size = {width, height, depth};
  return size;
}

typedef enum : NSUInteger {
  MTLDataTypeFloat = 3,
  MTLDataTypeInt = 29,
  MTLDataTypeUInt = 33,
  MTLDataTypeBool = 53,
} MTLDataType;

typedef enum : NSUInteger {
  MTLLanguageVersion3_1 = (3 << 16) + 1,
} MTLLanguageVersion;

@protocol MTLDevice;
@protocol MTLCommandBuffer;

@protocol MTLResource <NSObject>
@end

@protocol MTLBuffer <MTLResource>
@end

@protocol MTLFunction <NSObject>
@end

@interface MTLFunctionConstantValues : NSObject
- (void)setConstantValue:(const void*)value type:(MTLDataType)type atIndex:(NSUInteger)index;
@end

@interface MTLCompileOptions : NSObject
@property(readwrite, nonatomic) MTLLanguageVersion languageVersion;
// API_DEPRECATED("Use mathMode instead", macos(10.11, 15.0)): mathMode needs macOS 15.
@property(readwrite, nonatomic) BOOL fastMathEnabled;
@end

@protocol MTLLibrary <NSObject>
@property(readonly) NSArray<NSString*>* functionNames;
- (nullable id<MTLFunction>)newFunctionWithName:(NSString*)name
                                 constantValues:(MTLFunctionConstantValues*)constantValues
                                          error:(__autoreleasing NSError**)error;
@end

@protocol MTLComputePipelineState <NSObject>
@property(readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@property(readonly) NSUInteger staticThreadgroupMemoryLength;
@end

@protocol MTLCommandEncoder <NSObject>
@end

@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setBuffer:(nullable id<MTLBuffer>)buffer
           offset:(NSUInteger)offset
          atIndex:(NSUInteger)index;
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid
       threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
@end

@protocol MTLCommandBuffer <NSObject>
@end
typedef void (^MTLCommandBufferHandler)(id<MTLCommandBuffer>);

@protocol MTLCommandQueue <NSObject>
@end

@protocol MTLEvent <NSObject>
@end
@protocol MTLSharedEvent <MTLEvent>
@end

@protocol MTLDevice <NSObject>
@property(readonly) NSUInteger maxThreadgroupMemoryLength;
- (nullable id<MTLLibrary>)newLibraryWithURL:(NSURL*)url
                                       error:(__autoreleasing NSError**)error;
- (nullable id<MTLLibrary>)newLibraryWithSource:(NSString*)source
                                        options:(nullable MTLCompileOptions*)options
                                          error:(__autoreleasing NSError**)error;
- (nullable id<MTLComputePipelineState>)
    newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                  error:(__autoreleasing NSError**)error;
@end

// ---- MetalPerformanceShaders(Graph): only the class names that torch's MPSStream.h uses -------

@interface MPSCommandBuffer : NSObject <MTLCommandBuffer>
@end

@interface MPSGraphObject : NSObject
@end
@interface MPSGraph : MPSGraphObject
@end
@interface MPSGraphExecutionDescriptor : MPSGraphObject
@end
@interface MPSGraphCompilationDescriptor : MPSGraphObject
@end

#pragma clang assume_nonnull end
