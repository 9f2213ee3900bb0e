"""tokenfab plan: arithmetic for choosing hardware and deployment settings, calibrated by measurement.

- `dtypes`     bytes per element of each number format, group-wise scale overhead included
- `models`     model architectures: presets with published numbers, or read from a GGUF / config.json
- `hardware`   the hardware catalog (`hardware.yaml`, extendable with user files)
- `roofline`   FLOPs and bytes of a step, and the step time they imply (the cost model)
- `memory`     what fits: weights, KV cache, activations, overhead; tensor-parallel options
- `cost`       cost per hour and per million tokens
- `workload`   length distributions, arrivals, SLO targets
- `simulate`   discrete-event simulation of the engine's scheduler under a step-cost model
               (the roofline, or tokenfab.costmodel's MeasuredStepCost fitted to measured step times)
- `capacity`   replicas needed to meet an SLO at a traffic rate
- `calibrate`  fit efficiency factors to timings of the real engine
- `probe`      measure this machine's bandwidth and matmul peak
"""
