import json, os, glob, collections, re
# python processes
P = []
for f in glob.glob('/tmp/proclog/*.json'):
    try: P.append(json.load(open(f)))
    except Exception: pass
print("python procs", len(P), "self CPU", round(sum(p['self'] for p in P)))
def kind(p):
    a = " ".join(p['argv'])
    exe = p['exe']
    if 'pytest' in a and 'xdist' not in a and p['test'] == '': return 'pytest-main/worker'
    for key in ('pip', 'sglang.bench_serving', 'torch.distributed.run', 'kernel/bench', 'gpu.doctor', 'doctor/probe', 'jit_kernels', 'standin', 'sglpatch', 'compileall', '_in_process', 'venv', 'pytest', 'uv'):
        if key in a: return key
    return 'other:' + (p['argv'][0][-40:] if p['argv'] else '?')
byk = collections.defaultdict(lambda: [0, 0.0, 0])
for p in P:
    k = kind(p); byk[k][0] += 1; byk[k][1] += p['self']; byk[k][2] += p['torch']
for k, v in sorted(byk.items(), key=lambda kv: -kv[1][1])[:30]:
    print(f"{v[1]:8.1f} {v[0]:5d} torch={v[2]:4d} {k}")
print("torch procs", sum(p['torch'] for p in P), round(sum(p['self'] for p in P if p['torch'])))
byt = collections.defaultdict(float)
for p in P:
    byt[p['test'].split(' ')[0]] += p['self']
print("--- python self CPU by test")
for k, v in sorted(byt.items(), key=lambda kv: -kv[1])[:25]: print(f"{v:7.1f} {k}")
# git
G = []
for f in glob.glob('/tmp/gitlog/*'):
    L = open(f).read().splitlines()
    if len(L) < 2: continue
    h = L[0].split('\t'); t = L[-1].split()
    try: c = float(t[0]) + float(t[1])
    except Exception: continue
    G.append((h[0], h[1] if len(h) > 1 else '', h[2] if len(h) > 2 else '', c))
print("git calls", len(G), "CPU", round(sum(g[3] for g in G)))
bys = collections.defaultdict(lambda: [0, 0.0])
for t, s, d, c in G: bys[s][0] += 1; bys[s][1] += c
for k, v in sorted(bys.items(), key=lambda kv: -kv[1][1])[:20]: print(f"{v[1]:7.1f} {v[0]:6d} {k}")
byt = collections.defaultdict(lambda: [0, 0.0])
for t, s, d, c in G: byt[t][0] += 1; byt[t][1] += c
print("--- git by test")
for k, v in sorted(byt.items(), key=lambda kv: -kv[1][1])[:25]: print(f"{v[1]:7.1f} {v[0]:6d} {k}")
print("--- unpacks (add) by test")
for t, s, d, c in sorted(G, key=lambda g: -g[3]):
    if s in ('add', 'repack', 'fetch', 'read-tree'): pass
adds = [(t, d, c) for t, s, d, c in G if s == 'add']
print(len(adds), round(sum(a[2] for a in adds)))
for a in adds: print(f"  {a[2]:5.2f} {a[0]}")
