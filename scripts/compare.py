#!/usr/bin/env python3
"""hf bench next to ucx_perftest and iperf3, in one run, on loopback, with the ratios.

    cargo build --release --bin hf && python3 scripts/compare.py [--duration SECS]

Needs Debian's ucx-utils (ucx_perftest) and iperf3. Each tool runs its own two processes
on this host, one tool after the other, so they share the machine's state of the moment:
compare the ratios, not the absolute figures, on a shared machine.

What is compared:
  shm://  vs UCX posix (UCX_TLS=posix,self): 64 B latency (half round trip, both),
          64 B message rate, 4 MiB bandwidth
  tcp://  vs UCX tcp (UCX_TLS=tcp): the same; and 4 MiB bandwidth vs iperf3 (one stream)

ucx_perftest's tag_bw counts at the sender (a message is done when the sender's buffer can
be reused), hyperframes counts at the receiver after reading every byte; iperf3 counts
received bytes. The table says which.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

HF = os.environ.get("HF", "target/release/hf")


def hf_bench(transports, duration):
    out = subprocess.run(
        [HF, "bench", "--transport", transports, "--duration", str(duration),
         "--json", "/dev/stdout"],
        check=True, capture_output=True, text=True,
    ).stdout
    points = {}
    for line in out.splitlines():
        if line.startswith("{"):
            p = json.loads(line)
            points[(p["transport"], p["pattern"], p["size"])] = p
    return points, "\n".join(l for l in out.splitlines() if not l.startswith("{"))


def ucx(tls, test, size, iters, port=13337):
    env = dict(os.environ, UCX_TLS=tls)
    server = subprocess.Popen(["ucx_perftest", "-p", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        out = subprocess.run(
            ["ucx_perftest", "127.0.0.1", "-p", str(port), "-t", test, "-s", str(size),
             "-n", str(iters)],
            env=env, check=True, capture_output=True, text=True, timeout=300,
        ).stdout
    finally:
        server.wait(timeout=30)
    final = [l for l in out.splitlines() if l.startswith("Final:")]
    if not final:
        raise RuntimeError(f"ucx_perftest {test} printed no Final line:\n{out}")
    f = final[0].split()
    # Final: iters lat50 lat_avg lat_overall bw_avg bw_overall rate_avg rate_overall
    return {"lat_p50_us": float(f[2]), "lat_avg_us": float(f[3]),
            "mb_per_s": float(f[6]), "msgs_per_s": float(f[8])}


def iperf3(duration, port=5299):
    server = subprocess.Popen(["iperf3", "-s", "-1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        out = subprocess.run(
            ["iperf3", "-c", "127.0.0.1", "-p", str(port), "-t", str(duration), "-J"],
            check=True, capture_output=True, text=True, timeout=120,
        ).stdout
    finally:
        server.wait(timeout=30)
    return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 8 / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=3.0)
    args = ap.parse_args()

    hf, table = hf_bench("shm,tcp", args.duration)
    print(table)
    print()
    rows = []
    for transport, tls in [("shm", "posix,self"), ("tcp", "tcp")]:
        lat = ucx(tls, "tag_lat", 64, 200_000 if transport == "shm" else 20_000)
        rate = ucx(tls, "tag_bw", 64, 2_000_000 if transport == "shm" else 500_000)
        bw = ucx(tls, "tag_bw", 4 << 20, 2000 if transport == "shm" else 500)
        h_lat = hf[(transport, "lat", 64)]["lat_us"]["p50"]
        h_rate = hf[(transport, "rate", 64)]["msgs_per_s"]
        h_bw = hf[(transport, "bw", 4 << 20)]["gbytes_per_s"]
        name = f"UCX {tls}"
        rows.append((f"{transport} 64 B latency p50 (µs, lower is better)",
                     h_lat, name, lat["lat_p50_us"], lat["lat_p50_us"] / h_lat))
        rows.append((f"{transport} 64 B message rate (msg/s; UCX counts at the sender)",
                     h_rate, name, rate["msgs_per_s"], h_rate / rate["msgs_per_s"]))
        rows.append((f"{transport} 4 MiB bandwidth (GB/s; UCX counts at the sender)",
                     h_bw, name, bw["mb_per_s"] * (1 << 20) / 1e9,
                     h_bw / (bw["mb_per_s"] * (1 << 20) / 1e9)))
    ip = iperf3(args.duration)
    h_bw = hf[("tcp", "bw", 4 << 20)]["gbytes_per_s"]
    rows.append(("tcp 4 MiB bandwidth (GB/s; iperf3: one stream, received)", h_bw, "iperf3",
                 ip, h_bw / ip))

    print(f"{'measure':<62} {'hyperframes':>12}  {'other':<16} {'figure':>10}  {'ratio':>6}")
    for what, ours, who, theirs, ratio in rows:
        print(f"{what:<62} {ours:>12.4g}  {who:<16} {theirs:>10.4g}  {ratio:>5.2f}×")
    print("\nratio > 1 means hyperframes is faster (for latency: theirs / ours)")


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, subprocess.CalledProcessError, RuntimeError) as e:
        sys.exit(f"compare.py: {e}")
