"""``tollgate.processes``' view of /proc: a process's children and a group's live members."""

from __future__ import annotations

import os
import subprocess

from tests.polling import wait_until
from tollgate.processes import children, group_running


def test_children_and_group_running_read_proc_and_skip_zombies():
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert child.pid in children(os.getpid())
        assert group_running(child.pid)
        child.kill()  # dead but not reaped yet: a zombie, which runs nothing
        wait_until(lambda: not group_running(child.pid), "the killed child to be a zombie")
        assert child.pid not in children(os.getpid())
    finally:
        child.kill()
        child.wait()
