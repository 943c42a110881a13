#!/usr/bin/env bash
# Nsight Compute profile of the benchmark kernels on the GPU machine (device tool): bash scripts/profile_ncu.sh
# carry: .device-cache. Key metrics print last; full reports under $OUT/ncu_*.txt.
set -x
export PYTHONPATH=$PWD ATTNJIT_CACHE_DIR=$PWD/.device-cache PYTHONUNBUFFERED=1
chmod -R go-w .device-cache; chmod 700 .device-cache
python3 -m attnjit.cli warm specs/bench.toml -j 16 | tail -1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
for w in prefill decode1 decode64; do
  timeout 200 $NCU --clock-control none -k regex:attnjit_attention --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section InstructionStats \
    python3 benchmarks/profile_kernels.py $w > $OUT/ncu_$w.txt 2>&1
  grep -E "Duration|Throughput|Warp Cycles|Issued Ipc|Eligible|No Eligible|Achieved Occupancy|Registers|Stall|Pipe|Bank|Executed Ipc|L1/TEX Hit|L2 Hit|DRAM" $OUT/ncu_$w.txt | head -60
done
