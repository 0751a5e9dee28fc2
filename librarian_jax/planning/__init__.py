"""Planning a run for the hardware it will rent: `topology` (Cloud TPU slices, their chips' figures and
compile-only devices) and `plan` (every program of a run compiled for a slice from shapes: memory, FLOPs,
what fits, the projected step). Import the modules themselves; this package imports neither."""
