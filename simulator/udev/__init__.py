"""Hot-plug on a simulated node: its trees change as the kernel changes them, and uevents reach the processes
that watch it through umockdev's preload library."""
