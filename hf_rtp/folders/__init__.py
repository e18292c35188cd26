"""Safe operations in a folder that is the user's: hf_rtp deletes, moves or overwrites only files it can prove
it wrote, and a save leaves a complete old or a complete new checkpoint at every instant (DESIGN.md)."""
