"""gpu/topology: `nvidia-smi topo -m` / `topo -p2p r` parsing and the topology class.

Fixtures in tests/fixtures/topo are nvidia-smi's own format (tab-separated, the legend and a NIC
row included): the user's class (two sockets, no switches), a box behind PCIe switches, one
socket on the root complex, two sockets with switches, and our 2x H200 (NVLink)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglpatch.gpu.shared import topology

FIX = Path(__file__).parent / "fixtures" / "topo"


def load(name: str) -> topology.Topology:
    return topology.parse_matrix((FIX / f"{name}.txt").read_text())


@pytest.mark.parametrize("name, klass", [
    ("two-sockets-no-switch", "two-sockets-no-switch"),
    ("switches", "switches"),
    ("one-socket", "one-socket"),
    ("two-sockets-switches", "two-sockets-switches"),
    ("nvlink-h200x2", "nvlink"),
])
def test_class_of_each_fixture(name, klass):
    assert topology.classify(load(name))[0] == klass


def test_the_users_class_in_detail():
    topo = load("two-sockets-no-switch")
    assert topo.gpus == list(range(8))
    assert topo.numa == {g: g // 4 for g in range(8)}
    assert topo.cpu_affinity[5] == "32-63,96-127"
    assert topo.links[(0, 3)] == "NODE" and topo.links[(3, 4)] == "SYS"
    assert len(topo.links) == 28  # GPU pairs only: the NIC column is not a GPU
    klass, why = topology.classify(topo)
    assert why == ("two sockets without PCIe switches (12 NODE, 16 SYS of 28 pairs; "
                   "NUMA 0: GPU 0,1,2,3, NUMA 1: GPU 4,5,6,7)")


def test_p2p_matrix_names_the_missing_pair():
    topo = load("two-sockets-no-switch")
    topology.parse_p2p((FIX / "p2p-two-sockets-cns.txt").read_text(), topo)
    assert len(topo.p2p) == 56
    assert topo.p2p[(2, 5)] == "CNS" and topo.p2p[(5, 2)] == "CNS" and topo.p2p[(0, 1)] == "OK"
    rep = topology.report(topo)
    assert rep["p2p_missing"] == ["2->5", "5->2"]
    assert rep["class"] == "two-sockets-no-switch" and rep["links"]["0-7"] == "SYS"


def test_ansi_codes_and_space_separated_copies():
    text = (FIX / "switches.txt").read_text()
    coloured = text.replace("\tGPU0", "\t\x1b[4mGPU0", 1).replace("GPU7\tCPU", "GPU7\x1b[0m\tCPU", 1)
    assert topology.classify(topology.parse_matrix(coloured))[0] == "switches"
    spaced = text.replace("\t", "    ")
    assert topology.classify(topology.parse_matrix(spaced))[0] == "switches"


def test_nothing_parsed_is_unknown_and_one_gpu_is_single():
    assert topology.classify(topology.parse_matrix(""))[0] == "unknown"
    assert topology.classify(topology.parse_matrix("No devices were found\n"))[0] == "unknown"
    one = "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-15\t0\t\tN/A\n"
    assert topology.classify(topology.parse_matrix(one))[0] == "single-gpu"


def test_read_runs_a_real_program(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\ncase \"$2\" in -m) cat '{FIX}/one-socket.txt';; "
                    f"-p2p) cat '{FIX}/p2p-two-sockets-cns.txt';; esac\n")
    fake.chmod(0o755)
    topo, raw = topology.read(str(fake))
    assert topology.classify(topo)[0] == "one-socket" and raw["matrix"] and raw["p2p"]
    assert topo.p2p[(2, 5)] == "CNS"
    topo, raw = topology.read(str(tmp_path / "missing"))
    assert raw == {"matrix": None, "p2p": None} and topology.classify(topo)[0] == "unknown"


def test_two_sockets_with_one_switched_pair_is_still_without_switches():
    topo = load("two-sockets-no-switch")
    topo.links[(0, 1)] = "PIX"  # one pair under a switch; the other same-socket pairs cross the root complex
    assert topology.classify(topo)[0] == "two-sockets-no-switch"
