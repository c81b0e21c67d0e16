#!/usr/bin/env python3
"""PyTorch side of the SimCSE step benchmark: one unsupervised SimCSE training step of a BERT
encoder (all-MiniLM-L6-v2 by default) -- B sentences encoded twice in one batch (dropout on),
mean pooling, MLP head, InfoNCE (temperature 0.05), backward, AdamW -- the same step as
allgrad's `crates/allgrad-bench/src/bin/bench_simcse_step/`, which drives this script as a worker so that the two
implementations alternate step by step in one invocation (`scripts/bench/bench_simcse_step.sh`).

    python3 scripts/bench/bench_simcse_step.py --batch 64 --steps 3      # a quick look, alone
    python3 scripts/bench/bench_simcse_step.py --batch 64 --worker       # serve the driver

Worker protocol: one command per line on stdin (`step`, `layers`, `quit`), one answer line on
stdout per command: `STEP wall= user= sys= minflt= fwd= bwd= opt= bwd_minflt=` (seconds, faults;
user, sys and minor faults from getrusage(RUSAGE_SELF), i.e. all threads of this process), or
one `LAYER kind= count= fwd= bwd=` line per op kind followed by `DONE` (`layer_times`: each op of
the encoder timed alone at its shape in the step, mirroring
`crates/allgrad-bench/src/bin/bench_simcse_step/layers.rs`). The first line is
`READY torch=<version> threads=<n> interop=<n>`. With `--device cuda` each STEP line also has
`gpu_peak=` (torch.cuda.max_memory_allocated() over the step, MiB).

The thread count (`--threads`, default 2) goes to torch.set_num_threads,
torch.set_num_interop_threads and, before torch is imported, to OMP_NUM_THREADS and
MKL_NUM_THREADS. Needs torch, transformers and tokenizers (kept out of CI); without torch this
exits with status 2.
"""
import argparse
import os
import resource
import sys
import time

def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64, help="sentences per step (2B sequences)")
    ap.add_argument("--threads", type=int, default=2, help="intra- and inter-op threads")
    ap.add_argument("--model", default="data/models/all-MiniLM-L6-v2", help="a Hugging Face BERT folder")
    ap.add_argument("--sentences", default="data/wordnet/sentences.txt", help="one sentence a line; the first B")
    ap.add_argument("--max-len", type=int, default=32, help="truncation, special tokens included")
    ap.add_argument("--steps", type=int, default=3, help="timed steps when run alone")
    ap.add_argument("--worker", action="store_true", help="serve step/quit commands on stdin")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the step runs")
    ap.add_argument(
        "--precision",
        default="full",
        choices=("full", "tf32", "bf16"),
        help="full: f32 (TF32 off on CUDA); tf32: cuBLAS and cuDNN may use TF32 (CUDA); "
        "bf16: the forward under torch.autocast(bfloat16), the loss in f32 (allgrad's precision: bf16)",
    )
    return ap.parse_args()


ARGS = parse_args()
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)
try:
    import torch
except ImportError:
    print("bench_simcse_step.py: PyTorch is not installed (pip install torch)", file=sys.stderr)
    sys.exit(2)
sys.dont_write_bytecode = True  # no __pycache__ in scripts/
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "reference"))
try:
    from simcse_torch import SimCse, read_sentences, simcse_loss, tokenize  # noqa: E402
except ImportError as e:
    # No PyTorch side without transformers and tokenizers: the driver runs allgrad alone.
    print(f"bench_simcse_step.py: {e} (pip install transformers tokenizers)", file=sys.stderr)
    sys.exit(2)


def usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), r.ru_utime, r.ru_stime, r.ru_minflt


class Autocast(torch.nn.Module):
    """The encoder's forward under torch.autocast(bfloat16), its embeddings cast to f32, so that
    the loss and its logits are f32 (as allgrad's `precision: bf16` computes them)."""

    def __init__(self, model, device):
        super().__init__()
        self.model, self.device = model, device

    def forward(self, ids, mask):
        with torch.autocast(self.device, dtype=torch.bfloat16):
            return self.model(ids, mask).float()


def layer_times(batch, model_dir, max_len):
    """Forward and backward seconds of every op kind of the step's encoder, head and loss, each
    op timed alone at its shape (2B sequences of max_len tokens): the forward, then
    `y.backward(g)` with a random upstream gradient. As transformers' BERT runs them: q, k and v
    as three dense layers, attention by scaled_dot_product_attention with an additive key mask
    and dropout 0.1, post-LayerNorm, exact GELU, `dropout(x) + residual`. `softmax` is the
    scores' softmax alone (inside the attention in the step)."""
    import json

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    h, heads, inter, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    n, seq = 2 * batch, max_len
    d = h // heads
    r = lambda *s: torch.randn(*s, requires_grad=True)
    F = torch.nn.functional

    def instances(kind):
        if kind == "linear":
            shapes = [(n * seq, h, h)] * 3 + [(n * seq, h, h), (n * seq, h, inter), (n * seq, inter, h)]
            for rows, i, o in shapes * layers + [(n, h, h)]:
                lin, x = torch.nn.Linear(i, o), r(rows, i)
                yield lambda lin=lin, x=x: lin(x)
        elif kind == "attention":
            for _ in range(layers):
                q, k, v = r(n, seq, h), r(n, seq, h), r(n, seq, h)
                bias = torch.zeros(n, 1, 1, seq)

                def attend(q=q, k=k, v=v, bias=bias):
                    split = lambda t: t.view(n, seq, heads, d).transpose(1, 2)
                    ctx = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=bias, dropout_p=0.1)
                    return ctx.transpose(1, 2).reshape(n, seq, h)

                yield attend
        elif kind == "layer_norm":
            for _ in range(2 * layers + 1):
                x, g, b = r(n, seq, h), r(h), r(h)
                yield lambda x=x, g=g, b=b: F.layer_norm(x, (h,), g, b, cfg.get("layer_norm_eps", 1e-12))
        elif kind == "gelu":
            for _ in range(layers):
                x = r(n, seq, inter)
                yield lambda x=x: F.gelu(x)
        elif kind == "softmax":
            for _ in range(layers):
                x = r(n, heads, seq, seq)
                yield lambda x=x: torch.softmax(x, dim=-1)
        elif kind == "dropout":
            for i in range(2 * layers + 1):
                x, res = r(n, seq, h), r(n, seq, h)
                yield (lambda x=x: F.dropout(x, 0.1, True)) if i == 0 else (lambda x=x, res=res: F.dropout(x, 0.1, True) + res)
        elif kind == "loss":
            z = r(n, h)

            def loss(z=z):
                a, c = z[:batch], z[batch:]
                a = a / a.norm(dim=1, keepdim=True)
                c = c / c.norm(dim=1, keepdim=True)
                return F.cross_entropy(a @ c.t() / 0.05, torch.arange(batch))

            yield loss

    lines = []
    for kind in ("linear", "attention", "layer_norm", "gelu", "softmax", "dropout", "loss"):
        fwd = bwd = 0.0
        count = 0
        for forward in instances(kind):
            t0 = time.perf_counter()
            y = forward()
            t1 = time.perf_counter()
            g = torch.randn_like(y)
            t2 = time.perf_counter()
            y.backward(g)
            t3 = time.perf_counter()
            fwd, bwd, count = fwd + t1 - t0, bwd + t3 - t2, count + 1
            del y, g
        lines.append(f"LAYER kind={kind} count={count} fwd={fwd:.6f} bwd={bwd:.6f}")
    return lines


class Step:
    """The model (dropout on), AdamW and the token batch of one batch size; `run` times one
    training step."""

    def __init__(self, batch, model_dir, sentences, max_len):
        torch.manual_seed(0)
        texts = read_sentences(sentences)[:batch]
        rows, pad_id = tokenize(os.path.join(model_dir, "tokenizer.json"), texts, max_len)
        self.views, self.pad_id = [rows, rows], pad_id
        self.device = ARGS.device
        self.model = SimCse(model_dir, "mean", True).to(self.device)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-5, weight_decay=0.0)
        # On a GPU, phase boundaries wait for the device (as allgrad's side does).
        self.sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
        self.forward = Autocast(self.model, self.device) if ARGS.precision == "bf16" else self.model

    def run(self):
        cuda = self.device == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        start = usage()
        loss = simcse_loss(self.forward, self.views, self.pad_id, 0.05)
        self.sync()
        at_fwd = usage()
        t_fwd = at_fwd[0]
        self.opt.zero_grad()
        loss.backward()
        self.sync()
        at_bwd = usage()
        t_bwd = at_bwd[0]
        self.opt.step()
        self.sync()
        t_opt = time.perf_counter()
        del loss
        end = usage()
        wall, user, sys_, flt = (e - s for e, s in zip(end, start))
        # On a GPU: the peak of the caching allocator's allocated bytes during the step, in MiB.
        peak = f" gpu_peak={torch.cuda.max_memory_allocated() / 2**20:.1f}" if cuda else ""
        return (f"STEP wall={wall:.6f} user={user:.6f} sys={sys_:.6f} minflt={flt} "
                f"fwd={t_fwd - start[0]:.6f} bwd={t_bwd - t_fwd:.6f} opt={t_opt - t_bwd:.6f} "
                f"bwd_minflt={at_bwd[3] - at_fwd[3]}{peak}")


def main():
    torch.set_num_threads(ARGS.threads)
    torch.set_num_interop_threads(ARGS.threads)
    if ARGS.device == "cuda":
        if not torch.cuda.is_available():
            print("bench_simcse_step.py: --device cuda, but torch.cuda.is_available() is False", file=sys.stderr)
            sys.exit(2)
        torch.backends.cuda.matmul.allow_tf32 = ARGS.precision == "tf32"
        torch.backends.cudnn.allow_tf32 = ARGS.precision == "tf32"
    step = Step(ARGS.batch, ARGS.model, ARGS.sentences, ARGS.max_len)
    if not ARGS.worker:
        for _ in range(ARGS.steps + 1):  # the first step warms up
            print(step.run(), flush=True)
        return
    print(f"READY torch={torch.__version__} threads={torch.get_num_threads()} "
          f"interop={torch.get_num_interop_threads()}", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "step":
            print(step.run(), flush=True)
        elif cmd == "layers":
            print("\n".join(layer_times(ARGS.batch, ARGS.model, ARGS.max_len) + ["DONE"]), flush=True)
        elif cmd == "quit":
            break
        else:
            print(f"ERROR unknown command {cmd!r}", flush=True)


if __name__ == "__main__":
    main()
