#!/usr/bin/env python3
"""hf bench next to the tools our users would pick instead, in one run, with the ratios.

    python3 scripts/compare.py [--duration SECS] [--rounds N] [--modes pinned,unpinned]
                               [--json FILE] [--markdown]

Builds what it runs (hf; the peer programs in scripts/peers), then measures, on this host,
over loopback, each tool in its own two processes (inproc: two threads):

  hyperframes  hf bench: tcp (the default engine, with --busy-poll, and on I/O threads),
               tls (against tcp), shm (copying, --zero-copy, --busy-poll), inproc
  UCX          ucx_perftest (Debian ucx-utils): tag_lat / tag_bw over posix shared memory
               (UCX_TLS=posix,self) and over tcp (UCX_TLS=tcp)
  ZeroMQ       scripts/peers/zmq (libzmq3-dev): REQ/REP latency, PUSH/PULL rate and bandwidth
  tokio        scripts/peers/tokio_tcp: a plain tokio TcpStream with hyperframes' framing
  iceoryx2     scripts/peers/iceoryx2: publish/subscribe over shared memory, zero-copy
  iperf3       one TCP stream, -l 1M
  openssl      `openssl speed -evp aes-128-gcm -bytes 16384` on one CPU: the cipher's own
               limit, against tls bandwidth (tls:// seals 16 KiB records with AES-128-GCM)
  c2c          scripts/peers/c2c: a cache line handed between the two CPUs and back (the floor
               under every shared-memory latency), run with each set of figures

Every point runs --rounds times, the tools interleaved (round 1 of everything, then round
2, ...), so a burst of noise on a shared host hits every tool rather than one; the table
gives the median and the spread (min-max) of each figure, and ratios of medians. Modes:
"pinned" puts the two sides on CPUs 0 and 1 (--pin 0,1; taskset-style options of each tool),
"unpinned" leaves placement to the scheduler. The placement of CPUs 0 and 1 (same core? same
package?) is read from sysfs and printed, and the core-to-core probe (c2c) measures what a
cache-line hand-off between the two sides costs in each mode.

How each tool counts: hf bench counts at the receiver after reading each message (rate, bw)
and reports half the round trip (lat), as ucx_perftest does; ucx_perftest's tag_bw counts at
the sender; iperf3 counts received bytes; the peer programs count at the receiver.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "scripts" / "peers"
HF = Path(os.environ.get("HF", ROOT / "target" / "release" / "hf"))
TOKIO = PEERS / "tokio_tcp" / "target" / "release" / "tokio-tcp-bench"
ZMQ = PEERS / "zmq" / "zmq_bench"
IOX2 = PEERS / "iceoryx2" / "target" / "release" / "iox2-bench"
C2C = PEERS / "c2c" / "c2c"
MIB4 = 4 << 20


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# building


def build():
    """Builds hf and each peer; returns the set of peers that built (and why the others not)."""
    log("building hf ...")
    subprocess.run(["cargo", "build", "--release", "--bin", "hf"], cwd=ROOT, check=True)
    have, missing = set(), {}
    steps = {
        "tokio": (["cargo", "build", "--release"], PEERS / "tokio_tcp"),
        "iceoryx2": (["cargo", "build", "--release"], PEERS / "iceoryx2"),
        "zeromq": (["make"], PEERS / "zmq"),
        "c2c": (["make"], PEERS / "c2c"),
    }
    for name, (cmd, cwd) in steps.items():
        log(f"building the {name} peer ...")
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
        if r.returncode == 0:
            have.add(name)
        else:
            missing[name] = (r.stderr.strip().splitlines() or ["build failed"])[-1]
    for tool, exe in [("ucx", "ucx_perftest"), ("iperf3", "iperf3"), ("openssl", "openssl")]:
        if subprocess.run(["sh", "-c", f"command -v {exe}"], capture_output=True).returncode == 0:
            have.add(tool)
        else:
            missing[tool] = f"{exe} not installed"
    return have, missing


# ---------------------------------------------------------------------------------------------
# placement


def cpu_topology(cpu):
    base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")

    def read(name):
        try:
            return (base / name).read_text().strip()
        except OSError:
            return "?"

    return {"core": read("core_id"), "package": read("physical_package_id"),
            "siblings": read("thread_siblings_list")}


def placement():
    a, b = cpu_topology(0), cpu_topology(1)
    if "?" in (a["core"], b["core"]):
        where = "topology unknown (no sysfs)"
    elif a["package"] != b["package"]:
        where = f"different packages ({a['package']}, {b['package']})"
    elif a["core"] == b["core"]:
        where = f"SMT siblings of core {a['core']} (they share the core's caches and pipeline)"
    else:
        where = f"different cores ({a['core']}, {b['core']}) of package {a['package']}"
    virt = "?"
    try:
        virt = subprocess.run(["systemd-detect-virt"], capture_output=True,
                              text=True).stdout.strip() or "none"
    except OSError:
        pass
    return f"CPUs 0 and 1: {where}; {os.cpu_count()} CPUs; virtualisation: {virt}"


# ---------------------------------------------------------------------------------------------
# the tools


def hf(args, duration, pinned, env=None):
    """One hf bench run; {(transport, pattern, size): point} and the memcpy baseline."""
    cmd = [str(HF), "bench", "--duration", str(duration), "--json", "/dev/stdout", *args]
    if pinned:
        cmd += ["--pin", "0,1"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, **(env or {}))).stdout
    points, baseline = {}, None
    for line in out.splitlines():
        if line.startswith("{"):
            p = json.loads(line)
            points[(p["transport"], p["pattern"], p["size"])] = p
        m = re.search(r"memcpy of 4 MiB .*?: ([0-9.]+) GB/s", line)
        if m:
            baseline = float(m.group(1))
    return points, baseline


def cpu_per_msg_us(p):
    return (p["cpu"]["user_s"] + p["cpu"]["sys_s"]) / max(p["messages"], 1) * 1e6


def hf_figures(label, args, duration, pinned, env=None):
    """Figures named `label/transport/pattern/size` (and their CPU per message)."""
    points, baseline = hf(args, duration, pinned, env)
    out = {}
    for (t, pat, size), p in points.items():
        key = f"{label}/{t}/{pat}/{size}"
        if pat == "lat":
            out[key] = p["lat_us"]["p50"]
        elif pat == "rate":
            out[key] = p["msgs_per_s"]
        else:
            out[key] = p["gbytes_per_s"]
        out[key + "/cpu"] = cpu_per_msg_us(p)
    if baseline is not None and "--buffers" not in args:
        # (with other buffers the baseline copies from another working set)
        out["memcpy/4MiB"] = baseline
    return out


def peer(exe, pattern, size, duration, pinned, extra=()):
    cmd = [str(exe), "--pattern", pattern, "--size", str(size), "--duration", str(duration),
           *extra]
    if pinned:
        cmd += ["--pin", "0,1"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120).stdout
    j = json.loads(out.strip().splitlines()[-1])
    if j.get("lost"):
        raise RuntimeError(f"{exe.name} lost {j['lost']} messages")
    return {"lat": j.get("lat_p50_us"), "rate": j.get("msgs_per_s"),
            "bw": j.get("gbytes_per_s")}[pattern]


_port = [13400]


def ucx(tls, test, size, iters, pinned):
    _port[0] += 1
    port = str(_port[0])
    env = dict(os.environ, UCX_TLS=tls)
    aff_s, aff_c = (["-c", "1"], ["-c", "0"]) if pinned else ([], [])
    server = subprocess.Popen(["ucx_perftest", "-p", port, *aff_s], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.7)
        out = subprocess.run(
            ["ucx_perftest", "127.0.0.1", "-p", port, "-t", test, "-s", str(size),
             "-n", str(iters), *aff_c],
            env=env, check=True, capture_output=True, text=True, timeout=300,
        ).stdout
    finally:
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    final = [l for l in out.splitlines() if l.startswith("Final:")]
    if not final:
        raise RuntimeError(f"ucx_perftest {test} printed no Final line:\n{out}")
    f = final[0].split()
    # Final: iters lat50 lat_avg lat_overall bw_avg bw_overall rate_avg rate_overall
    if test == "tag_lat":
        return float(f[2])
    if size >= MIB4:
        return float(f[6]) * (1 << 20) / 1e9
    return float(f[8])


def iperf3(duration, pinned):
    _port[0] += 1
    port = str(_port[0])
    server = subprocess.Popen(["iperf3", "-s", "-1", "-p", port],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        out = subprocess.run(
            ["iperf3", "-c", "127.0.0.1", "-p", port, "-t", str(max(1, round(duration))),
             "-l", "1M", "-J",
             *(["-A", "0,1"] if pinned else [])],
            check=True, capture_output=True, text=True, timeout=120,
        ).stdout
    finally:
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 8 / 1e9


def openssl_gcm(pinned):
    """AES-128-GCM on 16 KiB blocks, one CPU (CPU 0 when pinned), in GB/s."""
    cmd = ["openssl", "speed", "-evp", "aes-128-gcm", "-bytes", "16384", "-seconds", "2"]
    if pinned:
        cmd = ["taskset", "-c", "0", *cmd]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60).stdout
    # The last line: `AES-128-GCM    4049573.18k` (thousands of bytes per second).
    m = re.search(r"^AES-128-GCM\s+([0-9.]+)k\s*$", out, re.M)
    if not m:
        raise ValueError(f"no AES-128-GCM figure in openssl's output: {out[-200:]!r}")
    return float(m.group(1)) * 1e3 / 1e9


def c2c(pinned):
    cmd = [str(C2C), *(["--pin", "0,1"] if pinned else [])]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60).stdout
    return json.loads(out)["one_way_ns"]


def one_round(have, d, pinned):
    """Every figure of one round, as {name: value}; a tool that fails is left out, logged."""
    fig = {}

    def run(name, f):
        try:
            v = f()
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, RuntimeError,
                ValueError, KeyError) as e:
            log(f"  {name}: failed: {str(e).strip().splitlines()[-1:]}")
            return
        if isinstance(v, dict):
            fig.update(v)
        elif v is not None:
            fig[name] = v

    lat_rate_64 = ["--pattern", "lat,rate", "--size", "64"]
    run("hf", lambda: hf_figures("hf", ["--transport", "tcp,tls,shm"], d, pinned))
    run("hf", lambda: hf_figures("hf", ["--transport", "inproc", *lat_rate_64], d, pinned))
    run("hf", lambda: hf_figures("hf-busy", ["--transport", "tcp,shm,inproc", "--pattern",
                                              "lat", "--busy-poll"], d, pinned))
    run("hf", lambda: hf_figures("hf-threads", ["--transport", "tcp", *lat_rate_64], d, pinned,
                                 env={"HYPERFRAMES_IO": "threads"}))
    run("hf", lambda: hf_figures("hf-zc", ["--transport", "shm", "--pattern", "bw",
                                            "--zero-copy"], d, pinned))
    # iperf3's working set: one buffer sent again and again, hot in the cache.
    run("hf", lambda: hf_figures("hf-1buf", ["--transport", "tcp", "--pattern", "bw",
                                              "--buffers", "1"], d, pinned))
    if "tokio" in have:
        for pat, size in [("lat", 64), ("rate", 64), ("rate", 32768), ("bw", MIB4)]:
            run(f"tokio/{pat}/{size}", lambda: peer(TOKIO, pat, size, d, pinned))
    if "zeromq" in have:
        for pat, size in [("lat", 64), ("rate", 64), ("rate", 32768), ("bw", MIB4)]:
            run(f"zmq/{pat}/{size}", lambda: peer(ZMQ, pat, size, d, pinned))
    if "iceoryx2" in have:
        run("iox2/lat/64", lambda: peer(IOX2, "lat", 64, d, pinned))
        run("iox2/rate/64", lambda: peer(IOX2, "rate", 64, d, pinned))
        run(f"iox2/bw/{MIB4}", lambda: peer(IOX2, "bw", MIB4, d, pinned, ["--buffer", "2"]))
    if "ucx" in have:
        for tls, short, lat_n, rate_n, bw_n in [("posix,self", "posix", 1_000_000, 4_000_000,
                                                 4000), ("tcp", "tcp", 50_000, 1_000_000, 1000)]:
            run(f"ucx-{short}/lat/64", lambda: ucx(tls, "tag_lat", 64, lat_n, pinned))
            run(f"ucx-{short}/rate/64", lambda: ucx(tls, "tag_bw", 64, rate_n, pinned))
            run(f"ucx-{short}/bw/{MIB4}", lambda: ucx(tls, "tag_bw", MIB4, bw_n, pinned))
    if "iperf3" in have:
        run(f"iperf3/bw/{MIB4}", lambda: iperf3(d, pinned))
    if "openssl" in have:
        run("openssl/aes-128-gcm", lambda: openssl_gcm(pinned))
    if "c2c" in have:
        run("c2c/ns", lambda: c2c(pinned))
    return fig


# ---------------------------------------------------------------------------------------------
# the table

# (what, ours, theirs, goal): ratio = ours / theirs, so below 1 is better for latencies and
# above 1 for rates; goal: the ratio the issues ask for.
ROWS = [
    ("tcp 64 B latency p50 (µs)", "hf/tcp/lat/64", "tokio/lat/64", "≤ 1.1"),
    ("tcp 64 B latency p50 (µs)", "hf/tcp/lat/64", "zmq/lat/64", "≤ 1.0"),
    ("tcp 64 B latency p50, busy-poll (µs)", "hf-busy/tcp/lat/64", "ucx-tcp/lat/64",
     "≤ 1.0"),
    ("tcp 64 B latency p50, I/O threads (µs)", "hf-threads/tcp/lat/64", "tokio/lat/64",
     ""),
    ("tcp 64 B rate (msgs/s)", "hf/tcp/rate/64", "zmq/rate/64", "≥ 1.5"),
    ("tcp 64 B rate (msgs/s)", "hf/tcp/rate/64", "tokio/rate/64", ""),
    ("tcp 64 B rate, I/O threads (msgs/s)", "hf-threads/tcp/rate/64", "zmq/rate/64",
     ""),
    ("tcp 32 KiB rate (msgs/s)", "hf/tcp/rate/32768", "zmq/rate/32768", "≥ 2"),
    ("tcp 32 KiB rate (msgs/s)", "hf/tcp/rate/32768", "tokio/rate/32768", ""),
    ("tcp 4 MiB bandwidth (GB/s)", f"hf/tcp/bw/{MIB4}", f"iperf3/bw/{MIB4}", "≥ 1.0"),
    ("tcp 4 MiB bandwidth, one buffer as iperf3 (GB/s)", f"hf-1buf/tcp/bw/{MIB4}",
     f"iperf3/bw/{MIB4}", ""),
    ("tcp 4 MiB bandwidth (GB/s)", f"hf/tcp/bw/{MIB4}", f"tokio/bw/{MIB4}", ""),
    ("tcp 4 MiB bandwidth (GB/s)", f"hf/tcp/bw/{MIB4}", f"ucx-tcp/bw/{MIB4}", ""),
    ("tcp 4 MiB bandwidth (GB/s)", f"hf/tcp/bw/{MIB4}", f"zmq/bw/{MIB4}", ""),
    ("tls 64 B latency p50 (µs)", "hf/tls/lat/64", "hf/tcp/lat/64", ""),
    ("tls 64 B rate (msgs/s)", "hf/tls/rate/64", "hf/tcp/rate/64", ""),
    ("tls 32 KiB rate (msgs/s)", "hf/tls/rate/32768", "hf/tcp/rate/32768", ""),
    ("tls 4 MiB bandwidth (GB/s)", f"hf/tls/bw/{MIB4}", f"hf/tcp/bw/{MIB4}", ""),
    ("tls 4 MiB bandwidth (GB/s)", f"hf/tls/bw/{MIB4}", "openssl/aes-128-gcm", ""),
    ("shm 64 B latency p50 (µs)", "hf/shm/lat/64", "ucx-posix/lat/64", ""),
    ("shm 64 B latency p50 (µs)", "hf/shm/lat/64", "iox2/lat/64", ""),
    ("shm 64 B latency p50, busy-poll (µs)", "hf-busy/shm/lat/64", "ucx-posix/lat/64",
     "≤ 1.0"),
    ("shm 64 B rate (msgs/s)", "hf/shm/rate/64", "ucx-posix/rate/64", "≥ 1.0"),
    ("shm 64 B rate (msgs/s)", "hf/shm/rate/64", "iox2/rate/64", ""),
    ("shm 4 MiB bandwidth, copying (GB/s)", f"hf/shm/bw/{MIB4}", "memcpy/4MiB",
     "≥ 0.9"),
    ("shm 4 MiB bandwidth, zero-copy (GB/s)", f"hf-zc/shm/bw/{MIB4}", f"iox2/bw/{MIB4}", "≥ 1.2"),
    ("shm 4 MiB bandwidth, copying (GB/s)", f"hf/shm/bw/{MIB4}", f"ucx-posix/bw/{MIB4}", ""),
    ("inproc 64 B latency p50 (µs)", "hf/inproc/lat/64", "hf/shm/lat/64", ""),
    ("inproc 64 B latency p50, busy-poll (µs)", "hf-busy/inproc/lat/64", "hf/shm/lat/64", ""),
    ("inproc 64 B rate (msgs/s)", "hf/inproc/rate/64", "hf/shm/rate/64", "≥ 1.0"),
]

WHO = {"tokio": "tokio TcpStream", "zmq": "ZeroMQ", "ucx-tcp": "UCX tcp",
       "ucx-posix": "UCX posix", "iox2": "iceoryx2", "iperf3": "iperf3 -l 1M",
       "memcpy": "memcpy, 1 process", "hf": "hf",
       "openssl": "openssl AES-128-GCM, 1 CPU"}


def who(key):
    name = key.split("/")[0]
    if key.startswith("hf/"):
        return "hf " + key.split("/")[1]
    if key.startswith("iox2/bw"):
        return "iceoryx2 (depth 2)"
    if key.startswith("zmq/lat"):
        return "ZeroMQ REQ/REP"
    if key.startswith("zmq/"):
        return "ZeroMQ PUSH/PULL"
    if key.startswith("ucx-") and "/lat/" not in key:
        return WHO[name] + " (at sender)"
    return WHO.get(name, name)


def fmt(v):
    if v is None:
        return "-"
    if v >= 1e6:
        return f"{v / 1e6:.3g} M"
    if v >= 1e4:
        return f"{v / 1e3:.3g} k"
    return f"{v:.3g}"


def summarize(rounds):
    keys = set().union(*rounds) if rounds else set()
    return {k: sorted(r[k] for r in rounds if k in r) for k in keys}


def spread(vs):
    if not vs:
        return "-"
    if len(vs) == 1:
        return fmt(vs[0])
    return f"{fmt(statistics.median(vs))} ({fmt(vs[0])}–{fmt(vs[-1])})"


def table(mode, s, markdown):
    lines = []
    head = ("point", "hyperframes", "CPU µs/msg", "other", "figure", "ratio", "goal")
    if markdown:
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
    else:
        lines.append(f"{head[0]:<42} {head[1]:>24} {head[2]:>10}  {head[3]:<24} "
                     f"{head[4]:>24} {head[5]:>7}  {head[6]}")
    for what, ours, theirs, goal in ROWS:
        a, b = s.get(ours, []), s.get(theirs, [])
        if not a or not b:
            continue
        ma, mb = statistics.median(a), statistics.median(b)
        ratio = ma / mb if mb else float("nan")
        cpu = s.get(ours + "/cpu")
        cpu = f"{statistics.median(cpu):.2f}" if cpu else "-"
        if "/bw/" in ours and cpu != "-":
            cpu = f"{statistics.median(s[ours + '/cpu']) * 1e-3:.2f} ms"
        row = (what, spread(a), cpu, who(theirs), spread(b), f"{ratio:.2f}×", goal)
        if markdown:
            lines.append("| " + " | ".join(row) + " |")
        else:
            lines.append(f"{row[0]:<42} {row[1]:>24} {row[2]:>10}  {row[3]:<24} {row[4]:>24} "
                         f"{row[5]:>7}  {row[6]}")
    title = f"{mode}: median (min–max) of each figure; ratio = ours / theirs"
    return title + "\n" + "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=2.0, help="seconds per point")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every point, interleaved")
    ap.add_argument("--modes", default="pinned,unpinned", help="pinned, unpinned or both")
    ap.add_argument("--json", help="write every figure of every round to this file")
    ap.add_argument("--markdown", action="store_true", help="print the tables as markdown")
    ap.add_argument("--no-build", action="store_true", help="use what is built")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in ("pinned", "unpinned"):
            sys.exit(f"compare.py: unknown mode {m!r} (pinned, unpinned)")

    if args.no_build:
        have = {n for n, p in [("tokio", TOKIO), ("zeromq", ZMQ), ("iceoryx2", IOX2),
                               ("c2c", C2C)] if p.exists()} | {"ucx", "iperf3", "openssl"}
        missing = {}
    else:
        have, missing = build()
    for name, why in missing.items():
        log(f"not compared: {name}: {why}")

    started = time.strftime("%Y-%m-%d %H:%M:%S")
    rounds = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes:
            log(f"round {r + 1}/{args.rounds}, {m} ...")
            rounds[m].append(one_round(have, args.duration, m == "pinned"))

    print(f"compare.py, {started}; {args.rounds} rounds of {args.duration} s per point")
    print(placement())
    for m in modes:
        s = summarize(rounds[m])
        print()
        print(table(m, s, args.markdown))
        if "c2c/ns" in s:
            print(f"\ncore-to-core probe ({m}): a cache line from one side to the other takes "
                  f"{spread(s['c2c/ns'])} ns one way")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"started": started, "placement": placement(), "rounds": rounds}, f,
                      indent=1)


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, subprocess.CalledProcessError) as e:
        sys.exit(f"compare.py: {e}")
