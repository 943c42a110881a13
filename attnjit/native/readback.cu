// attnjit/native/readback.cu: the read-back of device metadata in one launch (attnjit/ops/_readback.py).
//
// plan() with metadata on the device needs a few small int32 tensors on the host (indptrs, last page lengths, the
// page ids or their range). One cudaMemcpyAsync each costs the host several microseconds and the copies run one
// after another; this kernel gathers up to READBACK_SEGMENTS of them into one pinned host buffer (mapped: under
// unified addressing a cudaHostAlloc'd pointer is valid on the device) in one launch, and the plan synchronizes
// once. The package ships this file's PTX, loaded by the driver's JIT (no compiler at run time); after a change,
// regenerate it (tests/test_readback.py checks that the two are in step):
//   nvcc -ptx -arch=compute_80 attnjit/native/readback.cu -o /dev/stdout | grep -v '^//' |
//     sed -e 's/^\.version .*/.version 7.0/' -e '/./,$!d' > attnjit/native/readback.ptx
#define READBACK_SEGMENTS 8

struct ReadbackArgs {
  int* dst;                                  // the pinned host buffer (its device address)
  const int* src[READBACK_SEGMENTS];         // segment k: src[k][0 .. end[k] - end[k-1])
  int end[READBACK_SEGMENTS];                // cumulative element counts; unused segments repeat the last end
};

extern "C" __global__ void attnjit_readback(const ReadbackArgs a) {
  const int total = a.end[READBACK_SEGMENTS - 1];
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const int* from = a.src[0];  // selected, not indexed: a dynamic index would put the arguments in local memory
    int begin = 0;
#pragma unroll
    for (int s = 0; s < READBACK_SEGMENTS - 1; ++s)
      if (i >= a.end[s]) {
        from = a.src[s + 1];
        begin = a.end[s];
      }
    a.dst[i] = from[i - begin];
  }
}
