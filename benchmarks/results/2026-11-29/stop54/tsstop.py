import subprocess, time, sys, os, signal, threading, re
t0=time.time()
p=subprocess.Popen(sys.argv[1], shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
ready=threading.Event(); stopping=[None]
def rd():
    for l in p.stdout:
        if stopping[0] or re.search(sys.argv[2], l): print(f"{time.time()-t0:7.2f} {l.rstrip()[:200]}", flush=True)
        if re.search(sys.argv[2], l): ready.set()
threading.Thread(target=rd,daemon=True).start()
ready.wait(300); time.sleep(3)
stopping[0]=time.time(); print(f"{time.time()-t0:7.2f} SIGINT")
os.killpg(p.pid, signal.SIGINT); p.wait()
print(f"{time.time()-t0:7.2f} exited after {time.time()-stopping[0]:.2f}s")
