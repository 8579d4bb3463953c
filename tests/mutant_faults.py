"""The planted faults of the mutation check (tests/mutants.py runs them; results/mutants/ shows them).

One entry per fault: Mutant(id, area, kind, fault, file, edits, tests). ``file`` is relative to
the line's base folder (BASE: the SGLang tree's python/sglang/srt/ for a patch line, src/sglpatch/
for the tool); ``edits`` are (old, new) text replacements, each of which must match exactly once;
``tests`` are the test files that must catch it. To add a patch (e.g. 0005) or a line, add its
entries to MUTANTS (and BASE for a new line). The kinds (issue 29) are what a careful person gets
wrong when porting or editing: ``default`` (a rule tested only at default or convenient values:
GPU ids from 0 step 1, the installed version, sizes below a cap, this machine's architecture),
``number`` (a number handed on to upstream code or the user), ``verdict`` (a verdict or advice
sentence), ``ordering`` (events that complete late or out of order); the first faults (issue 18)
are ``rule`` (a rule inverted or dropped) and ``name`` (an upstream name misspelt).
"""

from __future__ import annotations

from typing import NamedTuple


class Mutant(NamedTuple):
    id: str
    area: str  # the patch (P1..P4) or the tool's module
    kind: str  # default | number | verdict | ordering | rule | name
    fault: str
    file: str
    edits: list[tuple[str, str]]
    tests: list[str]


BASE = {"0.5.23": "python/sglang/srt/", "0.5.9": "python/sglang/srt/", "tool": "src/sglpatch/"}

HOOK_0523 = """        # SGLANG_VERIFY_PROFILE=1 times each cycle's phases; off: nothing is wrapped.
        # Only the pipeline stage that hosts the draft runs whole cycles.
        self.spec_profiler = (
            maybe_profile_spec_worker(
                "eagle_v2",
                get_parallel().tp_rank,
                draft=(self._draft_worker, "draft"),
                verify=(self, "verify"),
                extend=(self._draft_worker, "_draft_extend_for_decode"),
                accept_lens=lambda out: out.accept_lens,
                dp_rank=get_parallel().dp_rank,
            )
            if self._hosts_draft
            else None
        )
"""
HOSTS = "        self._hosts_draft = get_parallel().pp_group.is_last_rank\n"
P1_0523, P4_0523 = "tests/real_0523/test_p1_0523.py", "tests/real_0523/test_p4_0523.py"
P1_0523_ARCH = "tests/real_0523/test_p1_0523_arch.py"  # issue 39: per GPU generation
P1, P2 = "tests/patches/test_p1_flashinfer_fusion.py", "tests/patches/test_p2_pcie_custom_ar.py"
P5 = "tests/patches/test_p5_pcie_ipc_allreduce.py"
P5SET = "tests/patches/test_p5_flashinfer_set.py"
F5 = "distributed/device_communicators/pcie_ipc_allreduce.py"
P7, F7 = "tests/patches/test_p7_b12x_group_coordinator.py", "distributed/device_communicators/b12x_allreduce.py"
P3, P4 = "tests/patches/test_p3_kimi_k25_eagle3.py", "tests/patches/test_p4_verify_profile.py"
P4_VERDICT = "tests/patches/test_p4_verdict.py"  # issue 39: the profiler's own verdict line
VERSION_CMP = ("pkg_version.parse(\n        flashinfer_version\n    ) < pkg_version.parse(min_version):",
               "(\n        flashinfer_version\n    ) < min_version:")  # compared as strings
POLL_READY = ("            if not ev[cycle.end].query():\n", "            if not ev[_VERIFY_END].query():\n")
ACCEPT_BY_REF = ("                cycle.accept = accept_lens.clone()\n", "                cycle.accept = accept_lens\n")
DROP_NEWEST = ("            self._release(self._pending.popleft())\n", "            self._release(self._pending.pop())\n")
PROFILE_REPORT, DECISION = "tests/test_profile_report.py", "tests/test_decision.py"
KERNEL = "tests/test_regress.py"  # the crossover, the cap and the judge, as units
P6T, JIT = "tests/patches/test_p6_jit_cccl.py", "tests/test_jitcheck.py"
ROPE = "../jit_kernel/rope.py"  # P6's file, beside srt/
CCCL_PATHS = ("        extra_include_paths=[str(p) for p in cccl_paths if p.exists()]\n        + [str(flashinfer_include_path)],\n")
SM120_FLAG = "_is_sm120_supported = _is_cuda and get_platform().is_sm120\n"
SM120_FLAG_BLACKWELL = (SM120_FLAG, SM120_FLAG.replace("get_platform().is_sm120", "get_platform().is_blackwell"))
SM120_FLAG_120_ONLY = (SM120_FLAG, SM120_FLAG.replace("get_platform().is_sm120", "get_platform().device_sm == 120"))

VERDICT_OVERALL = ('            if bs1["accept_length"] > rec["break_even_accept_length"]:\n',
                   '            if rec["accept_length"] > rec["break_even_accept_length"]:\n')
VERDICT_TIE = (VERDICT_OVERALL[0], VERDICT_OVERALL[0].replace(" > ", " >= "))
VERDICT_ADVICE = ('"(better drafter) or cut verify time, else disable speculation"', '"(better drafter) or cut verify time"')
REPORT_VERDICT = '        if bs1["accept_length"] > s["break_even_accept_length"]:'  # profile-report's comparison


def verdict_mutants(prefix: str, test: str) -> list[Mutant]:
    """The faults of the verdict line P4's profiler logs itself, on one line's spec_profiler.py
    (both lines carry the same file), each killed by test."""
    return [
        Mutant(f"{prefix}-verdict-overall-accept", "P4", "default", "the profiler's verdict compares the overall accept length, not batch 1's",
               "speculative/spec_profiler.py", [VERDICT_OVERALL], [test]),
        Mutant(f"{prefix}-verdict-advice-cut", "P4", "verdict", "the profiler's SLOWER verdict no longer advises disabling speculation",
               "speculative/spec_profiler.py", [VERDICT_ADVICE], [test]),
        Mutant(f"{prefix}-verdict-tie-beats", "P4", "rule", "an accept length exactly at the break-even is said to beat the baseline",
               "speculative/spec_profiler.py", [VERDICT_TIE], [test]),
    ]


MUTANTS: dict[str, list[Mutant]] = {
    "0.5.23": [
        Mutant("p4-hook-above-hosts-draft", "P4", "rule", "the profiling hook moved above the lines that set _hosts_draft/_draft_worker",
               "speculative/eagle_worker_v2.py", [(HOOK_0523, ""), (HOSTS, HOOK_0523 + HOSTS)], [P4_0523]),
        Mutant("p4-accept-lens-misspelt", "P4", "name", "upstream attribute misspelt: out.accept_len for out.accept_lens",
               "speculative/eagle_worker_v2.py", [("accept_lens=lambda out: out.accept_lens,", "accept_lens=lambda out: out.accept_len,")], [P4_0523]),
        Mutant("p4-env-name-misspelt", "P4", "name", "env name misspelt in environ.py: SGLANG_VERIFY_PROFILE_INTERVALS",
               "environ.py", [("    SGLANG_VERIFY_PROFILE_INTERVAL = ", "    SGLANG_VERIFY_PROFILE_INTERVALS = ")], [P4_0523]),
        # issue 39: the profiler's own verdict line, on this line's copy of spec_profiler.py
        *verdict_mutants("p4-0523", P4_0523),
        Mutant("p1-gate-removed", "P1", "rule", "the SM120 gate pass no longer run (model_hook.py)",
               "arg_groups/model_hook.py", [("    run_post_process_pass(server_args, _flashinfer_allreduce_fusion_sm120_gate)\n", "")], [P1_0523]),
        Mutant("p1-pcie-ipc-rule-inverted", "P1", "rule", "the PCIe-IPC rule inverted: the fusion yields when PCIe-IPC is off",
               "arg_groups/overrides.py", [("    if pcie_ipc_on:\n", "    if not pcie_ipc_on:\n")], [P1_0523]),
        Mutant("p1-base-gpu-id-misspelt", "P1", "name", "upstream attribute misspelt: view.base_gpu for view.base_gpu_id",
               "arg_groups/overrides.py", [("view.base_gpu_id + i", "view.base_gpu + i")], [P1_0523]),
        Mutant("p1-cuda-graph-config-misspelt", "P1", "name", "upstream attribute misspelt: graph.cuda_graph_configs",
               "layers/layer_boundary/residual/add_norm.py", [("get_exec().graph.cuda_graph_config\n", "get_exec().graph.cuda_graph_configs\n")], [P1_0523]),
        Mutant("p1-multicast-precheck-back", "P1", "rule", "the SM120 pre-check asks for the multicast granularity again",
               "layers/flashinfer_comm_fusion.py", [("        if get_platform().is_sm120:\n            # FlashInfer maps", "        if False:\n            # FlashInfer maps")], [P1_0523]),
        Mutant("p1-startup-line-dropped", "P1", "rule", "BaseRunner._warmup no longer logs the decode/verify allreduce",
               "model_executor/runner/base_runner.py", [("        self._log_decode_allreduce_path()\n", "")], [P1_0523]),
        Mutant("p1-startup-line-wrong-order", "P1", "rule", "the start-up line names PCIe-IPC ahead of the custom allreduce (not the dispatch order)",
               "layers/flashinfer_comm_fusion.py", [('    ca_comm = getattr(group, "ca_comm", None)\n', '    ca_comm = None\n')], [P1_0523]),
        # issue 29: the four kinds
        Mutant("p1-gpu-id-step-dropped", "P1", "default", "the P2P probe walks GPUs base_gpu_id + i (gpu_id_step ignored)",
               "arg_groups/overrides.py", [("view.base_gpu_id + i * view.gpu_id_step", "view.base_gpu_id + i")], [P1_0523]),
        Mutant("p1-version-floor-as-strings", "P1", "default", "the flashinfer floor compared as strings: 0.6.9 passes, 0.10.0 is refused",
               "arg_groups/overrides.py", [VERSION_CMP], [P1_0523]),
        Mutant("p1-sm100-blocked", "P1", "default", "SM100 no longer passes the gate untouched (only SM90 does)",
               "arg_groups/overrides.py", [("    if sm_major in (9, 10):\n        return None\n", "    if sm_major == 9:\n        return None\n")], [P1_0523]),
        Mutant("p1-token-limit-uncapped", "P1", "number", "the SM120 token limit no longer capped at upstream's maximum",
               "arg_groups/overrides.py", [("    return max(1, min(upstream_max, tokens))\n", "    return max(1, tokens)\n")], [P1_0523]),
        Mutant("p1-token-limit-no-spec-draft", "P1", "number", "without speculation the token limit still multiplies by the draft-token setting",
               "layers/layer_boundary/residual/add_norm.py",
               [("(spec.speculative_num_draft_tokens or 1) if spec.speculative_algorithm else 1,", "(spec.speculative_num_draft_tokens or 1),")], [P1_0523]),
        Mutant("p1-advice-unfused-dropped", "P1", "verdict", "the gate's warning no longer says the unfused allreduce is used",
               "arg_groups/overrides.py", [('        "Using the unfused allreduce. To use the fusion on SM120, install "\n',
                                            '        "To use the fusion on SM120, install "\n')], [P1_0523]),
        Mutant("p1-measured-path-advice-dropped", "P1", "verdict", "the fused start-up warning no longer names the measured path (PCIe-IPC)",
               "layers/flashinfer_comm_fusion.py", [(' The measured path is SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1."', '"')], [P1_0523]),
        # issue 39: the size P1 hands to upstream at start-up, the arch flag that picks the SM120-only limit
        Mutant("p1-prealloc-upstream-size", "P1", "number", "the workspace pre-allocated before graph capture is upstream's 2048 tokens "
               "on SM120 too, not the decode/verify width", "model_executor/runner/base_runner.py",
               [("            max_token_num=get_fuse_allreduce_max_tokens(),\n", "            max_token_num=2048,\n")], [P1_0523_ARCH]),
        Mutant("p1-sm120-flag-any-blackwell", "P1", "default", "the SM120 flag taken from is_blackwell: SM100/SM110 get the SM120-only "
               "token limit and workspace size", "layers/layer_boundary/residual/add_norm.py", [SM120_FLAG_BLACKWELL], [P1_0523_ARCH]),
        Mutant("p1-sm120-flag-sm121-left-out", "P1", "default", "the SM120 flag from compute capability 12.0 only: a 12.1 GPU keeps "
               "upstream's 2048", "layers/layer_boundary/residual/add_norm.py", [SM120_FLAG_120_ONLY], [P1_0523_ARCH]),
        Mutant("p4-read-before-extend-done", "P4", "ordering", "a cycle is read once its verify event completed, before its extend event",
               "speculative/spec_profiler.py", [POLL_READY], [P4_0523]),
        Mutant("p4-overflow-drops-newest", "P4", "ordering", "a full queue of unfinished cycles drops the newest, not the oldest",
               "speculative/spec_profiler.py", [DROP_NEWEST], [P4_0523]),
        Mutant("p4-accept-read-late", "P4", "ordering", "the accept lengths kept by reference: a tensor reused before the events complete is read late",
               "speculative/spec_profiler.py", [ACCEPT_BY_REF], [P4_0523]),
    ],
    "0.5.9": [
        Mutant("p1-p2p-rule-inverted", "P1", "rule", "the P2P rule inverted in get_flashinfer_allreduce_fusion_blocker",
               "server_args.py", [("    if not p2p_ok:\n", "    if p2p_ok:\n")], [P1]),
        Mutant("p2-missing-pairs-inverted", "P2", "rule", "the P2P matrix reports the pairs that work as missing",
               "distributed/device_communicators/custom_all_reduce.py", [("        if src != dst and not ok\n", "        if src != dst and ok\n")], [P2]),
        Mutant("p3-delegation-inverted", "P3", "rule", "Kimi-K2.5 delegation raises when the language model has the method",
               "models/kimi_k25.py", [("        if method is None:\n", "        if method is not None:\n")], [P3]),
        Mutant("p4-v1-bonus-token-dropped", "P4", "rule", "EAGLE v1 accept lengths without the bonus token",
               "speculative/eagle_worker.py", [("[n + 1 for n in out[1].accept_length_per_req_cpu]", "[n for n in out[1].accept_length_per_req_cpu]")], [P4]),
        # issue 29: the four kinds
        Mutant("p1-gpu-id-step-dropped", "P1", "default", "the P2P probe walks GPUs base_gpu_id + i (gpu_id_step ignored)",
               "server_args.py", [("self.base_gpu_id + i * self.gpu_id_step", "self.base_gpu_id + i")], [P1]),
        Mutant("p1-version-floor-as-strings", "P1", "default", "the flashinfer floor compared as strings: 0.6.9 passes, 0.10.0 is refused",
               "server_args.py", [VERSION_CMP], [P1]),
        Mutant("p2-one-stage-cap-at-4-ranks", "P2", "default", "the one-stage cap for 4 ranks taken as the 6-8 rank one (< 4, not <= 4)",
               "distributed/device_communicators/custom_all_reduce.py", [("(512 if world_size <= 4 else 256)", "(512 if world_size < 4 else 256)")], [P2]),
        Mutant("p2-cap-exclusive", "P2", "number", "a tensor of exactly the cap goes to NCCL (< for <=)",
               "distributed/device_communicators/custom_all_reduce.py",
               [("            return inp_size <= self.max_custom_ar_bytes\n", "            return inp_size < self.max_custom_ar_bytes\n")], [P2]),
        Mutant("p2-captured-bs-from-max-bs", "P2", "default", "the default cap reads cuda_graph_max_bs even when --cuda-graph-bs lists the sizes",
               "distributed/device_communicators/custom_all_reduce.py",
               [("        bs = max(args.cuda_graph_bs) if args.cuda_graph_bs else args.cuda_graph_max_bs\n",
                 "        bs = args.cuda_graph_max_bs\n")], [P2]),
        Mutant("p2-full-nvlink-flag-not-handed", "P2", "number", "sgl-kernel's init_custom_ar gets full_nvlink only (no kernel on PCIe ranks)",
               "distributed/device_communicators/custom_all_reduce.py",
               [("self.meta_ptrs, self.rank_data, rank, self.full_nvlink or pcie_custom_ar", "self.meta_ptrs, self.rank_data, rank, self.full_nvlink")], [P2]),
        Mutant("p2-advice-dropped", "P2", "verdict", "the PCIe warning no longer names SGLANG_ENABLE_PCIE_CUSTOM_AR=1",
               "distributed/device_communicators/custom_all_reduce.py",
               [('"for small tensors only, set SGLANG_ENABLE_PCIE_CUSTOM_AR=1."', '"for small tensors only, see the docs."')], [P2]),
        Mutant("p1-advice-unfused-dropped", "P1", "verdict", "the gate's warning no longer says the unfused allreduce is used",
               "server_args.py", [('                "Using the unfused allreduce. To use the fusion on SM120, install "\n',
                                   '                "To use the fusion on SM120, install "\n')], [P1]),
        # issue 39: the verdict sentence the profiler itself logs (not sglpatch profile-report's)
        *verdict_mutants("p4", P4_VERDICT),
        Mutant("p4-verdict-says-overall-accept", "P4", "verdict", "the profiler's verdict names the overall accept length as batch 1's",
               "speculative/spec_profiler.py", [("f\"batch 1: accept len {bs1['accept_length']:.2f}, break-even accept \"",
                                                 "f\"batch 1: accept len {rec['accept_length']:.2f}, break-even accept \"")], [P4_VERDICT]),
        Mutant("p4-read-before-extend-done", "P4", "ordering", "a cycle is read once its verify event completed, before its extend event",
               "speculative/spec_profiler.py", [POLL_READY], [P4]),
        Mutant("p4-overflow-drops-newest", "P4", "ordering", "a full queue of unfinished cycles drops the newest, not the oldest",
               "speculative/spec_profiler.py", [DROP_NEWEST], [P4]),
        Mutant("p4-accept-read-late", "P4", "ordering", "the accept lengths kept by reference: a tensor reused before the events complete is read late",
               "speculative/spec_profiler.py", [ACCEPT_BY_REF], [P4]),
        # P5 (0005, issue 26): PCIe-IPC allreduce backport
        Mutant("p5-pack-rounds-down", "P5", "number", "max_numel rounded down to a pack, not up (handed to flashinfer)",
               F5, [("return -(-numel // PCIE_IPC_PACK_ELEMS) * PCIE_IPC_PACK_ELEMS", "return numel // PCIE_IPC_PACK_ELEMS * PCIE_IPC_PACK_ELEMS")], [P5]),
        Mutant("p5-world-size-any", "P5", "default", "world sizes other than 2/4/8 admitted (only the convenient 8 tested)",
               F5, [("    if world_size not in PCIE_IPC_WORLD_SIZES:\n", "    if world_size < 2:\n")], [P5]),
        Mutant("p5-cap-exclusive", "P5", "number", "a reduction of exactly max_numel goes to the next backend (>= for >)",
               F5, [("inp.numel() > self.max_numel:", "inp.numel() >= self.max_numel:")], [P5]),
        Mutant("p5-capture-unprepared", "P5", "ordering", "inside a capture any supported shape is served, prepared or not",
               F5, [("            return inp.numel() // self.hidden in self._prepared\n", "            return self._workspace.supports(inp)\n")], [P5]),
        Mutant("p5-local-decision", "P5", "rule", "each rank decides on its own blocker, not the gathered ones",
               F5, [('blockers = [(r, f["blocker"]) for r, f in enumerate(facts) if f["blocker"]]', 'blockers = [(self.rank, blocker)] if blocker else []')], [P5]),
        Mutant("p5-warning-no-rank", "P5", "verdict", "the fallback warning no longer names the rank that turned it off",
               F5, [('self._warn(f"rank {blockers[0][0]}: {blockers[0][1]}")', 'self._warn(blockers[0][1])')], [P5]),
        Mutant("p5-no-rebind", "P5", "ordering", "the workspace is not rebound when the caller's stream changes",
               F5, [("            self._workspace.rebind_stream()\n", "            pass\n")], [P5]),
        Mutant("p5-first-call-unbound", "P5", "ordering", "the first call trusts != against None (torch.Stream answers False)",
               F5, [("        if self._stream is None or stream != self._stream:\n", "        if stream != self._stream:\n")], [P5]),
        Mutant("p5-workspace-keyword", "P5", "rule", "the workspace gets a keyword flashinfer 0.7.2's signature lacks",
               F5, [("        tune_cache=tune_cache,\n", "        cache_path=tune_cache,\n")], [P5SET]),
        Mutant("p5-p1-does-not-yield", "P5", "rule", "P1's gate ignores the PCIe-IPC switch",
               "server_args.py", [("    if pcie_ipc_on:\n", "    if False:\n")], [P5]),
        # P5's first start (issue 36): buckets, width, tune policy and cache, checks in and out of capture
        Mutant("p5-buckets-ladder", "P5", "rule", "the buckets are a power-of-two ladder, not the captured rows",
               F5, [("    buckets = [r for r in rows if r <= max_rows]\n",
                     "    buckets = [r for r in (1, 2, 4, 8, 16, 32, 64) if r <= max_rows]\n")], [P5]),
        Mutant("p5-override-not-rounded", "P5", "number", "SGLANG_PCIE_IPC_MAX_NUMEL handed on as given, not rounded up to a pack",
               F5, [("        max_numel = pcie_ipc_max_numel(1, override)\n", "        max_numel = override\n")], [P5]),
        Mutant("p5-override-below-row", "P5", "number", "an override below one row is accepted",
               F5, [("        if override < hidden:\n", "        if override < 1:\n")], [P5]),
        Mutant("p5-seed-reads-cache", "P5", "default", "a seed start still reads whatever cache file exists",
               F5, [('        self.tune_cache = path if policy == "cache" else os.devnull\n', "        self.tune_cache = path\n")], [P5]),
        Mutant("p5-unknown-tune-tunes", "P5", "default", "an unknown SGLANG_PCIE_IPC_TUNE value tunes at start",
               F5, [('        return "seed"\n    return policy\n', '        return "tune"\n    return policy\n')], [P5]),
        Mutant("p5-cache-key-no-buckets", "P5", "rule", "the cache's key leaves out the buckets: a cache for other buckets is used",
               F5, [('        "buckets": list(buckets),\n', '        "buckets": None,\n')], [P5]),
        Mutant("p5-tune-not-agreed", "P5", "rule", "ranks that see different tune caches each act on their own",
               F5, [("        if len(tunes) > 1:\n", "        if False:\n")], [P5]),
        Mutant("p5-noncontig-served", "P5", "rule", "a non-contiguous tensor is served (flashinfer raises inside a capture)",
               F5, [("        if not inp.is_contiguous() or inp.shape[-1] != self.hidden:\n", "        if inp.shape[-1] != self.hidden:\n")], [P5]),
        Mutant("p5-no-graphs-served", "P5", "rule", "--disable-cuda-graph does not block it (no runner ever builds the workspace)",
               F5, [("    if not graphs:\n", "    if False:\n")], [P5]),
        Mutant("p5-tune-step-unpinned", "P5", "default", "the tuning step runs without pinned clocks",
               "pcie_ipc_tune.py",
               [("    if args.pin_clocks is None and not args.clocks_pinned:\n", "    if False:\n")], [P5]),
        # ---- P5 through the real GroupCoordinator("tp"): tests/patches/test_p5_group_coordinator.py kills each ----
        Mutant("p5gc-guard-any-group", "P5", "rule", "every group with the switch on builds PCIe-IPC, not only the TP group",
               "distributed/parallel_state.py", [('            and group_name == "tp"\n', "")], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-guard-one-rank", "P5", "default", "a TP group of one rank builds PCIe-IPC too (world_size > 1 dropped)",
               "distributed/parallel_state.py", [('            and group_name == "tp"\n            and self.world_size > 1\n', '            and group_name == "tp"\n')],
               ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-ipc-before-ca", "P5", "ordering", "dispatch puts PCIe-IPC before custom allreduce (ca only where PCIe-IPC declines)",
               "distributed/parallel_state.py", [("            and self.ca_comm.should_custom_ar(input_)\n        ):\n",
                     "            and self.ca_comm.should_custom_ar(input_)\n            and not (self.pcie_ipc_comm is not None and not "
                     "self.pcie_ipc_comm.disabled and self.pcie_ipc_comm.should_pcie_ipc_ar(input_))\n        ):\n")], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-prepare-not-in-graph-capture", "P5", "ordering", "graph_capture no longer prepares the buckets before the capture",
               "distributed/parallel_state.py", [("        if self.pcie_ipc_comm is not None:\n            self.pcie_ipc_comm.prepare()\n", "")], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-p2-env-not-forced-off", "P5", "rule", "P2's CustomAllreduce still sees SGLANG_ENABLE_PCIE_CUSTOM_AR=1 when PCIe-IPC is agreed",
               F5, [('    os.environ[name] = "0"\n', "")], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-p2-env-not-restored-on-raise", "P5", "rule", "pcie_custom_ar_off puts SGLANG_ENABLE_PCIE_CUSTOM_AR back only when "
               "custom allreduce's constructor returns (the finally dropped): a raise leaves it off",
               F5, [("    try:\n        yield\n    finally:\n", "    yield\n    if True:\n")], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-p2-env-unset-left-off", "P5", "default", "an unset SGLANG_ENABLE_PCIE_CUSTOM_AR is left at 0 after the override, not unset",
               F5, [("            os.environ.pop(name, None)\n", '            os.environ[name] = "0"\n')], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-p2-ignored-every-rank", "P5", "verdict", "every rank warns that SGLANG_ENABLE_PCIE_CUSTOM_AR=1 is ignored, not rank 0 only",
               F5, [("if envs.SGLANG_ENABLE_PCIE_CUSTOM_AR.get() and rank == 0:", "if envs.SGLANG_ENABLE_PCIE_CUSTOM_AR.get():")],
               ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-p2-ignored-without-switch", "P5", "rule", "the SGLANG_ENABLE_PCIE_CUSTOM_AR=1-is-ignored warning also when it is unset",
               F5, [("if envs.SGLANG_ENABLE_PCIE_CUSTOM_AR.get() and rank == 0:", "if rank == 0:")], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-serve-fail-lost-p2-unsaid", "P5", "verdict", "a PCIe-IPC that fails at serve() with SGLANG_ENABLE_PCIE_CUSTOM_AR=1 does not say "
               "that P2's custom allreduce was not built", F5, [("            lost = \" (SGLANG_ENABLE_PCIE_CUSTOM_AR's custom allreduce was not built)\"\n",
                                                               '            lost = ""\n')], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-lost-p2-said-when-never-agreed", "P5", "rule", "the not-built note also where PCIe-IPC was never agreed (P2 was built as before)",
               F5, [("if self.agreed and envs.SGLANG_ENABLE_PCIE_CUSTOM_AR.get():", "if envs.SGLANG_ENABLE_PCIE_CUSTOM_AR.get():")],
               ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-lost-p2-said-without-switch", "P5", "rule", "the not-built note also without SGLANG_ENABLE_PCIE_CUSTOM_AR set",
               F5, [("if self.agreed and envs.SGLANG_ENABLE_PCIE_CUSTOM_AR.get():", "if self.agreed:")], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-outplace-returns-input", "P5", "number", "the out-of-place PCIe-IPC route hands back its input, not the reduction",
               "distributed/parallel_state.py", [("            out = pcie_ipc_comm.all_reduce(input_)\n", "            pcie_ipc_comm.all_reduce(input_)\n            out = input_\n")],
               ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-decode-line-every-rank", "P5", "verdict", "every rank of the TP group prints the decode/verify allreduce line",
               F5, [("    if group.rank_in_group != 0 or (\n", "    if (\n")], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-decode-line-at-construction", "P5", "ordering", "an agreed PCIe-IPC is named the decode/verify path at construction, "
               "before serve() built (or failed) its workspace (the old rule)",
               F5, [("        comm is not None and comm.agreed and not comm.served\n    ):\n        return\n", "        False\n    ):\n        return\n"),
                    ("    if pcie_ipc_comm is not None and not pcie_ipc_comm.disabled:\n", "    if pcie_ipc_comm is not None and pcie_ipc_comm.agreed:\n")],
               ["tests/patches/test_p5_group_coordinator.py"]),
        # ---- issue 52: the hollow cache, the race, the real server args, P2-only users, the tuning step's control ----
        Mutant("p5-tune-race-policy-only", "P5", "rule", "ranks that all ask for the cache agree on the policy alone, each acting on "
               "the cache state it saw (a cache that appeared or was replaced between two ranks' checks)",
               F5, [('        tunes = {f["tune"] for f in facts}\n', '        tunes = {f["tune"][0] for f in facts}\n')], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5-deterministic-unread", "P5", "rule", "--enable-deterministic-inference in the server args does not block it",
               F5, [("        return bool(args.enable_deterministic_inference), not args.disable_cuda_graph\n",
                     "        return False, not args.disable_cuda_graph\n")], [P5]),
        Mutant("p5-p2-only-forced-off", "P5", "rule", "P2-only users (P5's switch unset) get SGLANG_ENABLE_PCIE_CUSTOM_AR forced off",
               F5, [("    if comm is None or not comm.agreed:\n", "    if comm is not None and not comm.agreed:\n")], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5-hollow-cache-said-cache", "P5", "verdict", "a cache flashinfer loaded no entry from is still named 'cache' at start",
               F5, [('        if policy == "cache" and not cache_loaded(self._workspace):\n', "        if False:\n")], [P5, "tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5-tune-start-key-when-hollow", "P5", "rule", "a tune at start writes the key though the saved cache lacks a bucket",
               F5, [("        if covered != tuple(self.buckets):\n", "        if False:\n")], [P5]),
        Mutant("p5-tuned-buckets-every", "P5", "rule", "tuned_buckets counts every bucket, whatever flashinfer saved",
               F5, [("        in saved\n", "        or True\n")], ["tests/patches/test_p5_flashinfer_real.py"]),
        Mutant("p5-tune-step-no-coverage", "P5", "rule", "the tuning step writes a cache flashinfer saved without every bucket",
               "pcie_ipc_tune.py", [("        if missing:\n", "        if False:\n")], ["tests/patches/test_p5_pcie_ipc_tune.py"]),
        Mutant("p5-tune-step-other-workspace", "P5", "number", "the tuning step builds a workspace wider than the server's",
               "pcie_ipc_tune.py", [("        ws = build_workspace(dist.group.WORLD, max_numel, buckets, os.devnull)\n",
                                     "        ws = build_workspace(dist.group.WORLD, max_numel + 8, buckets, os.devnull)\n")], ["tests/patches/test_p5_pcie_ipc_tune.py"]),
        Mutant("p5-tune-step-waits-for-deadline", "P5", "rule", "one failing rank no longer stops the others: the step waits for them",
               "pcie_ipc_tune.py", [("            if any(p.exitcode not in (None, 0) for p in procs):\n                break\n",
                                     "            if any(p.exitcode not in (None, 0) for p in procs):\n                pass\n")], ["tests/patches/test_p5_pcie_ipc_tune.py"]),
        Mutant("p5-tune-step-no-reset-on-failure", "P5", "rule", "the pinned clocks are reset only after a run that tuned",
               "pcie_ipc_tune.py", [("        if args.pin_clocks is not None:\n            reset = ", "        if pinned and not pinned:\n            reset = ")],
               ["tests/patches/test_p5_pcie_ipc_tune.py"]),
        Mutant("p5gc-decode-path-served-not-built", "P5", "verdict", "the decode/verify line says PCIe-IPC once serve() ran, also when it failed",
               F5, [("    if pcie_ipc_comm is not None and not pcie_ipc_comm.disabled:\n", "    if pcie_ipc_comm is not None and pcie_ipc_comm.served:\n")],
               ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-decode-line-not-after-serve", "P5", "ordering", "the graph runner does not print the decode/verify line after serve() (an agreed "
               "PCIe-IPC names no path)", F5, [("        )\n        log_decode_allreduce_path(group)\n", "        )\n")],
               ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-destroy-skipped", "P5", "rule", "GroupCoordinator.destroy drops the adapter without destroying its workspace",
               "distributed/parallel_state.py", [("            self.pcie_ipc_comm.destroy()\n", "")], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-destroy-after-groups", "P5", "ordering", "the workspace is destroyed after the process groups are gone",
               "distributed/parallel_state.py", [("        if self.pcie_ipc_comm is not None:\n            # collective over cpu_group: before the groups go\n", "        if False:\n"),
                    ("            self.cpu_group = None\n", "            self.cpu_group = None\n        if self.pcie_ipc_comm is not None:\n"
                     "            self.pcie_ipc_comm.destroy()\n")], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-tune-local-decision", "P5", "rule", "each rank keeps its own tune policy and cache, not the agreed one",
               F5, [('        tunes = {f["tune"] for f in facts}\n', "        tunes = {(policy, state)}\n")], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-stale-cache-used", "P5", "rule", "SGLANG_PCIE_IPC_TUNE=cache takes a cache made for another width (only a missing one refused)",
               F5, [('        elif policy == "cache" and state != "match":\n', '        elif policy == "cache" and state == "absent":\n')], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-p2p-row-by-rank", "P5", "default", "the P2P row probes rank numbers, not the group's GPU ids",
               F5, [('rows = self._agree({"p2p": _p2p_row(device.index, devices)})',
                     'rows = self._agree({"p2p": _p2p_row(self.rank, list(range(self.world_size)))})')], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-p2p-pair-named-by-rank", "P5", "verdict", "the missing P2P pair is named by rank numbers, not GPU ids",
               F5, [('f"{devices[src]}->{devices[dst]}"', 'f"{src}->{dst}"')], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-buckets-raw-bs", "P5", "number", "the served rows come from --cuda-graph-bs as given, not the runner's clamped capture list",
               F5, [("[bs * runner.num_tokens_per_bs for bs in runner.capture_bs]",
                     "[bs * runner.num_tokens_per_bs for bs in runner.model_runner.server_args.cuda_graph_bs]")], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-max-numel-not-rounded", "P5", "number", "SGLANG_PCIE_IPC_MAX_NUMEL handed to flashinfer as given, not rounded up to a pack",
               F5, [("        max_numel = pcie_ipc_max_numel(1, override)\n", "        max_numel = override\n")], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-prepare-only-buckets", "P5", "number", "prepare resolves only the buckets, not every admitted row count",
               F5, [("        shapes = [(rows, self.hidden) for rows in range(1, max_rows + 1)]\n",
                     "        shapes = [(rows, self.hidden) for rows in self.buckets]\n")], ["tests/patches/test_p5_group_coordinator.py"]),
        Mutant("p5gc-strided-served", "P5", "rule", "a non-contiguous reduction is handed to PCIe-IPC",
               F5, [("        if not inp.is_contiguous() or inp.shape[-1] != self.hidden:\n", "        if inp.shape[-1] != self.hidden:\n")], ["tests/patches/test_p5_group_coordinator.py"]),
        # ---- end of the GroupCoordinator("tp") mutants ----
        # P6 (0006, issue 36): flashinfer's bundled CCCL for the rope JIT kernel
        Mutant("p6-cccl-dropped", "P6", "rule", "flashinfer's bundled CCCL folders not passed (data/include only, as before P6)",
               ROPE, [(CCCL_PATHS, "        extra_include_paths=[str(flashinfer_include_path)],\n")], [P6T]),
        Mutant("p6-libcudacxx-root", "P6", "name", "libcudacxx's root passed, not its include/ (flashinfer's jit/env.py names libcudacxx/include)",
               ROPE, [('cccl / "libcudacxx" / "include"', 'cccl / "libcudacxx"')], [P6T]),
        Mutant("p6-cccl-unconditional", "P6", "default", "the CCCL folders passed whether or not they exist (only a flashinfer that has them tested)",
               ROPE, [("[str(p) for p in cccl_paths if p.exists()]", "[str(p) for p in cccl_paths]")], [P6T]),
        # P7 (0007, issue 53): b12x's one-shot allreduce and fused add+RMSNorm, through the real GroupCoordinator("tp") and layer
        # communicator: tests/patches/test_p7_b12x_group_coordinator.py kills each
        Mutant("p7-world-size-any", "P7", "default", "world sizes other than b12x's 2/4/6/8 admitted (only the convenient 2 and 4 tested)",
               F7, [("    if world_size not in B12X_WORLD_SIZES:\n", "    if world_size < 2:\n")], [P7]),
        Mutant("p7-arch-any", "P7", "default", "any GPU admitted, not SM120/SM121 only (this machine's architecture never checked)",
               F7, [("    if capability not in B12X_CAPABILITIES:\n", "    if capability is None:\n")], [P7]),
        Mutant("p7-local-decision", "P7", "rule", "each rank decides on its own blocker, not the gathered ones",
               F7, [('blockers = [(r, f["blocker"]) for r, f in enumerate(facts) if f["blocker"]]', 'blockers = [(self.rank, blocker)] if blocker else []')], [P7]),
        Mutant("p7-warning-no-rank", "P7", "verdict", "the off warning no longer names the rank that turned it off",
               F7, [('self._warn(f"rank {blockers[0][0]}: {blockers[0][1]}")', 'self._warn(blockers[0][1])')], [P7]),
        Mutant("p7-p2p-pair-by-rank", "P7", "verdict", "the missing P2P pair is named by rank numbers, not GPU ids",
               F7, [('f"{devices[src]}->{devices[dst]}"', 'f"{src}->{dst}"')], [P7]),
        Mutant("p7-no-graphs-served", "P7", "rule", "--disable-cuda-graph does not block it (no runner ever builds the runtime)",
               F7, [("    if not graphs:\n", "    if False:\n")], [P7]),
        Mutant("p7-deterministic-served", "P7", "rule", "--enable-deterministic-inference does not block it",
               F7, [("    if deterministic:\n", "    if False:\n")], [P7]),
        Mutant("p7-width-raw-bs", "P7", "number", "the rows come from --cuda-graph-bs as given, not the runner's clamped capture list",
               F7, [("[bs * runner.num_tokens_per_bs for bs in runner.capture_bs]",
                     "[bs * runner.num_tokens_per_bs for bs in runner.model_runner.server_args.cuda_graph_bs]")], [P7]),
        Mutant("p7-width-no-draft-tokens", "P7", "number", "the rows are the captured batch sizes, the verify's draft tokens forgotten",
               F7, [("[bs * runner.num_tokens_per_bs for bs in runner.capture_bs]", "list(runner.capture_bs)")], [P7]),
        Mutant("p7-bytes-per-element", "P7", "number", "the runtime's size counts one byte per bf16 element (handed to b12x)",
               F7, [("        nbytes = width * hidden * torch.bfloat16.itemsize\n", "        nbytes = width * hidden\n")], [P7]),
        Mutant("p7-fused-past-36", "P7", "number", "fused plans up to the width, past b12x's 36 rows",
               F7, [("for surface, top in ((PLAIN, width), (FUSED, B12X_FUSED_MAX_ROWS)):", "for surface, top in ((PLAIN, width), (FUSED, width)):")], [P7]),
        Mutant("p7-rank-data-default", "P7", "number", "b12x's default rank data (8 MiB of pointer tables) instead of the 4 KiB a staged runtime uses",
               F7, [("                rank_data_bytes=B12X_RANK_DATA_BYTES,\n", "")], [P7]),
        Mutant("p7-stream-affine", "P7", "rule", "the runtime is stream-affine: SGLang's capture and serving streams are refused",
               F7, [("                stream_affine=False,\n", "                stream_affine=True,\n")], [P7]),
        Mutant("p7-prepare-launches", "P7", "ordering", "the plans are primed with a launch (a collective) while some rank may have failed its build",
               F7, [("        return api.PreparedCall(run=lambda: None)\n", "        return api.PreparedCall(run=lambda: state.run_plain(inp, inp))\n")], [P7]),
        Mutant("p7-served-before-prepare", "P7", "ordering", "it serves from serve(), before the first capture compiled its plans",
               F7, [("        self.max_rows, self.hidden = width, hidden\n",
                     "        self.max_rows, self.hidden = width, hidden\n        self.disabled = False\n"
                     "        self._plain, self._fused = self._declared[PLAIN], self._declared[FUSED]\n")], [P7]),
        Mutant("p7-prepare-not-in-graph-capture", "P7", "ordering", "graph_capture no longer prepares the plans before the capture",
               "distributed/parallel_state.py", [("        if self.b12x_comm is not None:\n            self.b12x_comm.prepare(self)\n", "")], [P7]),
        Mutant("p7-noncontig-served", "P7", "rule", "a non-contiguous reduction is handed to b12x (its plans are for contiguous rows)",
               F7, [("        if not inp.is_contiguous() or inp.shape[-1] != self.hidden:\n", "        if inp.shape[-1] != self.hidden:\n")], [P7]),
        Mutant("p7-fused-any-weight", "P7", "rule", "the fused kernel gets a weight of another dtype (b12x wants the input's)",
               F7, [("        x.dtype == residual.dtype == weight.dtype == torch.bfloat16\n", "        x.dtype == residual.dtype == torch.bfloat16\n")], [P7]),
        Mutant("p7-before-ca", "P7", "ordering", "dispatch puts b12x before custom allreduce (ca only where b12x declines)",
               "distributed/parallel_state.py", [("            and self.ca_comm.should_custom_ar(input_)\n        ):\n",
                     "            and self.ca_comm.should_custom_ar(input_)\n            and not (self.b12x_comm is not None and not "
                     "self.b12x_comm.disabled and self.b12x_comm.should_b12x_ar(input_))\n        ):\n")], [P7]),
        Mutant("p7-p5-built-too", "P7", "rule", "PCIe-IPC is built as well when the group agreed on b12x (two IPC workspaces, one serving)",
               "distributed/parallel_state.py", [("            and not b12x_replaces_pcie_ipc(self.b12x_comm, self.rank_in_group)\n", "")], [P7]),
        Mutant("p7-p5-ignored-every-rank", "P7", "verdict", "every rank warns that SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 is ignored, not rank 0 only",
               F7, [("    if rank == 0:\n        logger.warning(\n            \"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 is ignored: \"",
                     "    if True:\n        logger.warning(\n            \"SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1 is ignored: \"")], [P7]),
        Mutant("p7-p2-built", "P7", "rule", "P2's CustomAllreduce still sees SGLANG_ENABLE_PCIE_CUSTOM_AR=1 when b12x is agreed",
               F7, [('    os.environ[name] = "0"\n', "")], [P7]),
        Mutant("p7-lost-p5-unsaid", "P7", "verdict", "a b12x failing after agreement does not say that PCIe-IPC was not built",
               F7, [('    ("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE", "PCIe-IPC allreduce"),\n', "")], [P7]),
        Mutant("p7-p1-does-not-yield", "P7", "rule", "P1's trtllm fusion ignores the b12x switch on SM120",
               "server_args.py", [("    if b12x_on:\n", "    if False:\n")], [P7]),
        Mutant("p7-gate-ignores-b12x", "P7", "rule", "the fusion gate ignores b12x: the MoE keeps its allreduce, nothing fuses",
               "layers/communicator.py", [("    ) or _b12x_fuses(batch_size)\n", "    )\n")], [P7]),
        Mutant("p7-hook-skips-b12x", "P7", "rule", "the fusion hook's op goes to P1's trtllm code, not b12x, for the rows b12x fuses",
               "layers/flashinfer_comm_fusion.py", [("    if fused is not None:  # SGLANG_ENABLE_B12X_ALLREDUCE serves the fusion hook\n        return fused\n", "")], [P7]),
        Mutant("p7-decode-line-at-construction", "P7", "ordering", "an agreed b12x is named the decode/verify path before its kernels were built",
               F5, [("    if b12x_comm is not None and b12x_comm.agreed and b12x_comm.disabled:\n        return\n", "")], [P7]),
        Mutant("p7-decode-path-unnamed", "P7", "verdict", "the decode/verify line never says b12x one-shot",
               F5, [("    if b12x_comm is not None and not b12x_comm.disabled:\n", "    if False:\n")], [P7]),
        Mutant("p7-destroy-skipped", "P7", "rule", "GroupCoordinator.destroy drops the adapter without closing its session and runtime",
               "distributed/parallel_state.py", [("            self.b12x_comm.destroy()\n", "")], [P7]),
    ],
    "tool": [
        Mutant("profile-break-even-all-batches", "profile-report", "default", "break-even from the mean cycle of all batch sizes, not batch 1's",
               "gpu/profile_report.py", [('break_even_accept_length(bs1["cycle_ms_mean"], baseline_step_ms)', "break_even_accept_length(cycle_ms, baseline_step_ms)")],
               [PROFILE_REPORT]),
        Mutant("profile-verdict-overall-accept", "profile-report", "default", "the verdict compares the overall accept length, not batch 1's",
               "gpu/profile_report.py", [(REPORT_VERDICT, REPORT_VERDICT.replace("bs1[", "s["))], [PROFILE_REPORT]),
        Mutant("profile-verdict-tie-beats", "profile-report", "rule", "an accept length exactly at the break-even is said to beat the baseline",
               "gpu/profile_report.py", [(REPORT_VERDICT, REPORT_VERDICT.replace(" > ", " >= "))], [PROFILE_REPORT]),
        Mutant("profile-advice-cut", "profile-report", "verdict", "the SLOWER verdict no longer advises serving without speculation",
               "gpu/profile_report.py", [('or cut verify time, else serve without speculation"', 'or cut verify time"')], [PROFILE_REPORT]),
        Mutant("decision-verify-at-decode-rows", "decision", "number", "the projected cycle uses the decode-row latency difference, not the verify rows'",
               "gpu/kernel/decision.py", [('        cycle = base["spec_cycle_ms"] - d_ver\n', '        cycle = base["spec_cycle_ms"] - d_dec\n')], [DECISION]),
        Mutant("decision-verify-rows-sum", "decision", "default", "verify rows as batch + draft tokens - 1 (the same at batch 1)",
               "gpu/kernel/decision.py", [('cfg["batch_size"] * cfg["draft_tokens"]', 'cfg["batch_size"] + cfg["draft_tokens"] - 1')], [DECISION]),
        Mutant("decision-interpolation-mirrored", "decision", "number", "interpolation weights mirrored ((hi - n) for (n - lo))",
               "gpu/kernel/decision.py", [("* (n - lo) / (hi - lo)", "* (hi - n) / (hi - lo)")], [DECISION]),
        Mutant("crossover-first-loss", "kernel", "default", "the crossover taken at the first loss, a lone dip below it included",
               "gpu/kernel/tier.py", [("        if all(not wins[m] for m in sizes[i:]):\n", "        if not wins[n]:\n")], [KERNEL]),
        Mutant("p2-cap-bytes-per-element", "kernel", "number", "the recommended P2 cap counts 1 byte per bf16 element",
               "gpu/kernel/tier.py", [('"recommended_max_bytes": cap_rows * hidden * 2', '"recommended_max_bytes": cap_rows * hidden')], [KERNEL]),
        Mutant("judge-nccl-errors-pass", "kernel", "verdict", "the judge no longer fails a run whose NCCL backends failed to set up",
               "gpu/kernel/tier.py", [("            if b in NCCL_LABELS or (b in required and inst is installs[0]):\n",
                                  "            if b in required and inst is installs[0]:\n")], [KERNEL]),
        Mutant("bisect-skip-exit-code", "bisect", "number", "a step that cannot run exits 2 to git bisect run (bad), not 125 (skip)",
               "bisect/model.py", [("exitcodes.ERROR, exitcodes.CANNOT_RUN, 255", "exitcodes.ERROR, exitcodes.USAGE, 255")], ["tests/test_bisect.py"]),
        Mutant("jitcheck-nvcc-error-ignored", "jitcheck", "verdict", "a kernel whose build failed counts as built (nvcc's error ignored)",
               "pythonenv/jit_kernels.py", [('        if rec["state"] == "failed" and rec["objects"] and rec["built"] == rec["objects"] and rec["linked"]:\n',
                                '        if rec["state"] == "failed":\n')], [JIT]),
        Mutant("jitcheck-last-error", "jitcheck", "verdict", "the cause named is nvcc's last error line, not its first",
               "pythonenv/jit_kernels.py", [("        hit = next((ln for ln in lines if re.search(pat, ln)), None)\n",
                                "        hit = next((ln for ln in reversed(lines) if re.search(pat, ln)), None)\n")], [JIT]),
        Mutant("jitcheck-arch-unset", "jitcheck", "default", "TVM_FFI_CUDA_ARCH_LIST not set: SGLang asks the GPU (works only where one is)",
               "pythonenv/jit_kernels.py", [("        env.update(TVM_FFI_CUDA_ARCH_LIST=arch, TVM_FFI_CACHE_DIR=tmp, ", "        env.update(TVM_FFI_CACHE_DIR=tmp, ")], [JIT]),
        Mutant("doctor-jit-arch-default", "doctor", "default", "the doctor builds for 12.0 whatever the profile's [target] cuda_arch",
               "gpu/doctor/run.py", [('    arch = str((prof.get("target") or {}).get("cuda_arch") or jit_kernels.ARCH)\n',
                                      "    arch = jit_kernels.ARCH\n")], [JIT]),
        Mutant("fiset-way-back-unrecorded", "flashinfer set", "verdict", "the way back is not recorded in the workdir: the JIT failure cannot name it",
               "pythonenv/flashinfer_set.py", [("    if record and back:\n", "    if False:\n")], [JIT]),
    ],
}
