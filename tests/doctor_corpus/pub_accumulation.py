# expect: deprecated-api@20 removed-api@21 cuda-only@25 deprecated-api@30 host-read-in-loop@35 launch-nprocs@39
# Written here, not copied: gradient accumulation on XLA. The inner micro-batch loop holds
# backward(), the outer loop the optimizer step; the outer loop is scanned too, so the loss read
# after every optimizer step is found, while reads every 10 steps or at checkpoints are notes.
# CUDA autocast around the XLA forward turns bfloat16 silently off. TPU_AVAILABLE from
# `try: import torch_xla` (its else: CUDA, clean). Models holynakamoto/iacgpt
# scripts/base_train_tpu.py @ee3b17f6b3632caf6e7c90ab10a9c2625b7dd279 (l.43-44, 97-145, 107, 177).
# ruff: noqa
import torch

try:
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.xla_multiprocessing as xmp
    TPU_AVAILABLE = True
except ImportError:
    TPU_AVAILABLE = False


def train(rank, args, model, optimizer, get_batch):
    device = xm.xla_device() if TPU_AVAILABLE else torch.device("cuda")
    world_size = xm.xrt_world_size()
    for step in range(args.num_iterations):
        for micro in range(args.grad_accum):
            x, y = get_batch(device)
            with torch.cuda.amp.autocast(dtype=torch.bfloat16):
                loss = model(x, y) / args.grad_accum
            loss.backward()
        xm.optimizer_step(optimizer)
        optimizer.zero_grad()
        xm.mark_step()
        if step % 10 == 0:
            print(f"step {step} loss {loss.item() * args.grad_accum:.4f}")
        if step % args.save_every == 0 and rank == 0:
            torch.save({"loss": loss.item()}, f"ckpt_{step}.pt")
        print(f"{world_size} replicas, loss {loss.item():.4f}")


if __name__ == "__main__":
    xmp.spawn(train, args=(parse_args(), build_model(), None, None), nprocs=8)
