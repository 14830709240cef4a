import json, os, sys, gc, torch, torch.distributed as dist
import magnetar
from magnetar.engine.memory import phase1_need
from magnetar.engine.plan import kept_in
from magnetar.engine.strategy import plan_for_length

def st(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
n, method = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
eng = magnetar.init_inference("smollm2-135m-instruct", method=method, cp_size=int(os.environ["WORLD_SIZE"]), dtype="float32")
g = torch.Generator().manual_seed(0)
ids = torch.randint(100, 20000, (n,), generator=g)
eng.generate(ids[:64], torch.tensor([5, 6]), max_new_tokens=1)
gc.collect(); dist.barrier()
before = st("VmRSS"); open("/proc/self/clear_refs", "w").write("5")
eng.encoder.phase1(ids)
peak = st("VmHWM")
r = dist.get_rank(); room = eng.encoder.room
fw = [(kept_in(s), int(s.indices.numel())) for s in plan_for_length(eng.config, n, r).segments]
need = phase1_need(fw, room.per_token, room.act_per_token)
print(json.dumps(dict(rank=r, method=method, n=n, measured_mb=round((peak-before)/2**20), bound_mb=round(need[0]/2**20), ratio=round(need[0]/(peak-before), 2))), flush=True)
