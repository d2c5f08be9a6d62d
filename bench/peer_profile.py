"""`--profile N` for the PyTorch peers: N steps under torch.profiler after a warm-up, the
key_averages table (top 25 by device time), peak memory, and trace.json, as the mantissa
examples' `--profile N` prints theirs (bench/gpu_session.sh report puts both side by side).
"""
import os
import torch


def add_args(p):
    p.add_argument("--profile", type=int, default=0,
                   help="profile this many steps after --profile-warmup steps")
    p.add_argument("--profile-warmup", type=int, default=5)
    p.add_argument("--trace-dir", default="runs/peer", help="where trace.json goes")


def peak_memory(dev):
    """The peak allocated and reserved memory line both sides print on a GPU."""
    if dev.type != "cuda":
        return ""
    mib = 1 << 20
    return (f"peak allocated {torch.cuda.max_memory_allocated(dev) / mib:.1f} MiB, "
            f"reserved {torch.cuda.max_memory_reserved(dev) / mib:.1f} MiB")


def run(a, step, dev):
    """Runs `step()` --profile-warmup times, then --profile times under torch.profiler."""
    if a.profile <= 0:
        return
    for _ in range(a.profile_warmup):
        step()
    cuda = dev.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    with torch.profiler.profile(activities=acts, profile_memory=True) as prof:
        for _ in range(a.profile):
            step()
            prof.step()
        if cuda:
            torch.cuda.synchronize(dev)
    print(f"torch profile of {a.profile} steps after {a.profile_warmup} warm-up steps:")
    averages = prof.key_averages()
    keys = ["device_time_total", "cuda_time_total"] if cuda else ["cpu_time_total"]
    for key in keys:
        try:
            print(averages.table(sort_by=key, row_limit=25))
            break
        except (KeyError, AttributeError, ValueError):
            continue
    if cuda:
        print(f"torch profiled steps: {peak_memory(dev)}")
        # Device activities (kernels, copies, fills) per step: what the engine's step table
        # counts as launches plus library calls (a cuBLAS call can run more than one kernel,
        # which this counts each).
        kernels = sum(1 for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA)
        print(f"torch device activities per step: {kernels / a.profile:.0f}")
    os.makedirs(a.trace_dir, exist_ok=True)
    trace = os.path.join(a.trace_dir, "trace.json")
    prof.export_chrome_trace(trace)
    print(f"torch trace in {trace}")
