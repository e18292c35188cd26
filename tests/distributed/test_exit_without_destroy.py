"""A torchrun script that loads with hf_rtp (so hf_rtp made the world group), saves, and exits without
`destroy_process_group`: hf_rtp tears down what it made at exit, its groups and then the world group, as
vanilla's script would exit with nothing of hf_rtp's left to interpreter shutdown (a gloo group destroyed
there aborted a process once in 12 runs: "terminate called without an active exception", after SAVED).

The script registers its own exit handler before importing hf_rtp: atexit runs the last registered first,
so that handler runs after hf_rtp's and sees whether the world group is gone. (A world group the script
made itself is left to the script: hf_rtp destroys only the group object it made, groups.py.)"""

import json
import os
import subprocess

from support.models import make_tiny
from support.recipes import ENV, torchrun
from support.spawn import finish_launchers, free_port

SCRIPT = """
import atexit, json, sys
import torch.distributed as dist

atexit.register(lambda: print("AT_EXIT " + json.dumps(dist.is_initialized()), flush=True))
import hf_rtp

model = hf_rtp.from_pretrained(sys.argv[1])
model.save_pretrained(sys.argv[2])
print("SAVED", flush=True)
"""


def test_the_world_group_hf_rtp_made_is_destroyed_at_exit(tmp_path):
    ckpt = make_tiny("llama", tmp_path / "ckpt")
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    command = [*torchrun(2), "--master_port", str(free_port()), str(script), ckpt, str(tmp_path / "out")]
    proc = subprocess.Popen(
        command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    (output,) = finish_launchers([proc], timeout=240)
    assert proc.returncode == 0, output[-4000:]
    assert output.count("SAVED") == 2, output[-4000:]
    at_exit = [json.loads(line.split("AT_EXIT ", 1)[1]) for line in output.splitlines() if "AT_EXIT " in line]
    assert at_exit == [False, False], output[-4000:]  # today's torchrun: both ranks still initialised there
    assert os.path.exists(tmp_path / "out" / "model.safetensors")
