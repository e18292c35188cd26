"""The `hf-rtp` command line and its Python side, public as two modules: `hf_rtp.tools.memory`
(`estimate`, `load_config`, `model_states_bytes`: `hf-rtp estimate`) and `hf_rtp.tools.bench` (`main`:
`hf-rtp bench`). Nothing in the package imports these (DESIGN.md)."""
