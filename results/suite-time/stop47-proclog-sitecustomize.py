import atexit, os, sys, time
_T0 = time.time()
def _log():
    try:
        import json, resource
        s = resource.getrusage(resource.RUSAGE_SELF); c = resource.getrusage(resource.RUSAGE_CHILDREN)
        d = os.environ.get("PROCLOG_DIR", "/tmp/proclog")
        rec = {"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[:8], "exe": sys.executable, "cwd": os.getcwd() if os.path.exists(".") else "",
               "self": round(s.ru_utime + s.ru_stime, 3), "children": round(c.ru_utime + c.ru_stime, 3), "wall": round(time.time() - _T0, 2),
               "torch": "torch" in sys.modules, "sglang": "sglang" in sys.modules, "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
               "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
        with open(f"{d}/{os.getpid()}-{time.time_ns()}.json", "w") as f:
            json.dump(rec, f)
    except Exception:
        pass
atexit.register(_log)
