"""The `hf-rtp` command line, benches, the memory estimate and the cost model: nothing in the package imports
these (DESIGN.md)."""
