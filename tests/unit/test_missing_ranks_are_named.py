"""A meet that fails names the ranks on this host whose process is gone, a zombie or stopped, from the
(host, pid) every rank gave at load; a running rank, or one on another host, is not named."""

import os
import signal
import socket
import subprocess

from hf_rtp.distributed.ranks.rendezvous import _missing


def test_gone_zombie_and_stopped_ranks_are_named_running_and_remote_ones_are_not():
    host = socket.gethostname()
    running, stopped, zombie = (subprocess.Popen(["sleep", "60"]) for _ in range(3))
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        os.waitid(os.P_PID, stopped.pid, os.WSTOPPED | os.WNOWAIT)  # stopped now, not only signalled: /proc says T
        os.kill(zombie.pid, signal.SIGKILL)
        os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped: a zombie
        exited = subprocess.Popen(["true"])
        exited.wait()  # reaped: no such process any more
        assert _missing(((host, running.pid),)) == ""
        assert _missing(((host, running.pid), (host, stopped.pid))) == "rank 1"
        assert _missing(((host, zombie.pid), (host, running.pid), (host, exited.pid))) == "ranks 0, 2"
        assert _missing((("another-host", exited.pid),)) == ""  # cannot be looked at from here
    finally:
        for p in (running, stopped, zombie):
            p.kill()
            p.wait()


def test_a_rank_still_exiting_when_its_connection_broke_is_named_within_the_grace():
    """A killed rank's sockets close before /proc shows it gone: the meet that saw the connection break
    watches for it a moment instead of naming nobody (and a running rank is still not named)."""
    host = socket.gethostname()
    exiting, running = subprocess.Popen(["sleep", "0.5"]), subprocess.Popen(["sleep", "60"])
    try:
        assert _missing(((host, exiting.pid),)) == ""  # still running at this instant
        assert _missing(((host, running.pid), (host, exiting.pid)), grace_s=10.0) == "rank 1"
        assert _missing(((host, running.pid),), grace_s=0.2) == ""
    finally:
        for p in (exiting, running):
            p.kill()
            p.wait()
