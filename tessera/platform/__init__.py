"""The platform layer, low in the tree: what the engine asks of the machine it runs on.

- device.py: device and dtype resolution, the device kind's capabilities (pinned staging, graphs, the
  collective backend, memory), host copies; the only module that asks which kind of device it is;
- threads.py: the CPU's cores and the per-step thread policy;
- cpu_kernels.py: our C kernels for the CPU (csrc/), built once at worker start and reported;
- launch.py: starting the engine's child processes (schedulers, TP ranks, preprocessing workers).
"""
