"""The C kernels (csrc/) and their ctypes bindings: built once per machine, loaded where the CPU supports them."""
