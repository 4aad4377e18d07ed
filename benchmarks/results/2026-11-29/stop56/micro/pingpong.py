import socket, sys, time, os, statistics, select
mode = sys.argv[1]  # block | spin | spinserver | spinclient
N = 2000
def recv_block(s):
    return s.recv(64)
def recv_spin(s):
    while True:
        try:
            d = s.recv(64)
            return d
        except BlockingIOError:
            pass
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
if os.fork() == 0:
    os.sched_setaffinity(0, {1})
    a.close()
    if mode in ("spin", "spinserver"): b.setblocking(False); r = recv_spin
    else: r = recv_block
    for _ in range(N):
        r(b); b.sendall(b"y")
    os._exit(0)
os.sched_setaffinity(0, {0})
b.close()
if mode in ("spin", "spinclient"): a.setblocking(False); r = recv_spin
else: r = recv_block
ts = []
for i in range(N):
    if i % 10 == 0: time.sleep(0.002)  # idle like a verify... not between every ping
    t = time.perf_counter(); a.sendall(b"x"); r(a); ts.append(time.perf_counter() - t)
print(mode, "RTT median us", round(statistics.median(ts) * 1e6, 1), "p90", round(sorted(ts)[int(0.9 * N)] * 1e6, 1))
