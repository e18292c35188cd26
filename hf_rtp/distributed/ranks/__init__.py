"""Agreement between ranks: who is in which group, and calls every rank must make together. One module a job:

- `groups`: the process groups hf_rtp talks on, each with hf_rtp's timeout (DESIGN.md I5), never the default one;
- `rendezvous`: a call every rank must make meets the others first, and fails within a timeout, by name, when
  some rank skipped it;
- `agreement`: a failure on one rank is an error on every rank (`agreed`);
- `topology`: the world hf_rtp starts or joins, and the rings and replicas cut from it.
"""
