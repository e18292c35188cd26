"""The private names of torch, transformers, accelerate, bitsandbytes and torchao that hf_rtp relies on, reached
only from here.

One module per library (`torch_names`, `transformers_names`, `accelerate_names`, `bitsandbytes_names`,
`torchao_names`), each with the versions it was checked against (`TESTED`, from pyproject.toml's lower bound;
torchao's from the release .ci/run installs). A name is looked up
through `gate.lookup`, which raises IntegrationError naming it when the installed version is older than
those bounds or the name is gone, and warns once when the version is newer (gate.py says why); DESIGN.md
("Private names") lists every one, and tests/unit/test_private_names.py keeps the rest of the package from
reaching them directly. PEFT's and TRL's stand-ins keep their gates beside the code they replace
(integrations/peft.py, trl.py).

This package's __init__ imports nothing: distributed/ imports torch_names and must not reach transformers, and
bitsandbytes_names and torchao_names import their library only where a name is looked up (it is imported already
there), never at their top.
"""
