"""The ring's transport: how a rank's pieces reach its neighbour. The only folder that does point-to-point
communication, and within it only `ring` posts a message. One module a job:

- `ring`: the hop (`Ring.exchange`) and the walks of weights and gradients, forward and backward;
- `token_walk`: ops that move the tokens instead of the weights, their message and mechanism, on the ring's hops;
- `weights_or_tokens`: which of the two an op moves, from numbers every rank agreed (`Traffic`);
- `pool`: the slots foreign pieces and token messages land in, shared by every layer (DESIGN.md I3);
- `backends`: how the ring's messages travel, from the backend that carries the tensors' device: batched on NCCL,
  plain on gloo, staged through host memory where the backend cannot send the device's tensors; `staged` tells
  the collectives outside the ring the same (gloo serving CUDA tensors gathers and scatters host copies only);
- `watch`: the hops in flight watched from a thread where waits do not raise and tags are ignored (NCCL): a lost
  rank or a mismatched header named within the timeout;
- `pending`: waits that name what they waited for.
"""
