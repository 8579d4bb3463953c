"""`sglpatch doctor` (`run`; also `python -m sglpatch.gpu.doctor`): is this box ready for a load? Its checks: the
processes holding the GPUs (`procs`), the serving Python, driver and toolkits (`checks`, with `probe`), topology,
P2P and memory (`gpu`, with `p2p_probe`). The server tier asks it before a load (`run.gate_server`)."""
