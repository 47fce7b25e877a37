"""The edit loop's guard (tests/conftest.py): a test not marked integration starts no process, server or group."""

import os
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from fastdata.measure.machine import describe_machine


def test_a_process_started_by_the_test_is_refused_naming_it():
    with pytest.raises(RuntimeError, match=r"starts a process \(.*-c pass\) but is not marked integration"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_a_tcp_server_is_refused_and_a_unix_socket_is_not(tmp_path):
    with socket.socket() as server, pytest.raises(RuntimeError, match="starts a server on"):
        server.bind(("127.0.0.1", 0))
    with socket.socket(socket.AF_UNIX) as local:
        local.bind(os.fspath(tmp_path / "socket"))


def test_a_process_group_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="starts a process group"):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)


def test_processes_fastdata_starts_for_its_own_work_pass():
    assert describe_machine()["fastdata_git_commit"]  # `git rev-parse`, run by fastdata.measure.machine


@pytest.mark.integration
def test_an_integration_test_starts_what_it_needs():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
