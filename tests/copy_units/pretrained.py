# copies: pretrained.py checkpoint.py
# Your model's weights, saved as safetensors shards with an index (as the Hub stores a big model),
# streamed onto the device one tensor at a time; a wrong shape is named before anything moves.
import json, os
import torch, torch_xla
from safetensors.torch import save_file
import pretrained

torch.manual_seed(0)
reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
weights = reference.state_dict()
os.makedirs("model")
shards = {"model-00001-of-00002.safetensors": ["0.weight", "0.bias"],
          "model-00002-of-00002.safetensors": ["2.weight", "2.bias"]}
for file, names in shards.items():
    save_file({n: weights[n] for n in names}, f"model/{file}")
weight_map = {n: file for file, names in shards.items() for n in names}
with open("model/model.safetensors.index.json", "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
with torch.device(torch_xla.device()):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
done = pretrained.stream_to_device(model, "model")
assert done.tensors == 4 and done.largest_bytes == 16 * 8 * 4, done
x = torch.randn(3, 8)
assert torch.allclose(model(x.to(torch_xla.device())).cpu(), reference(x), atol=1e-6)
with torch.device(torch_xla.device()):
    wider = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
try:
    pretrained.stream_to_device(wider, "model")
except pretrained.CheckpointMismatch as exc:
    assert "'0.weight' has shape [16, 8], the model's [32, 8]" in str(exc), exc
else:
    raise AssertionError("a wrong shape was not named")


class Bigram(torch.nn.Module):  # a causal LM's interface: logits per position, from its token
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(10, 10)

    def forward(self, input_ids):
        return type("Output", (), {"logits": self.table(input_ids)})


lm = Bigram().to(torch_xla.device())
best = lm.table.weight.argmax(-1).cpu()  # each token's most likely next token


def chain(token, n):  # greedy: token -> best[token], n times
    out = []
    for _ in range(n):
        token = int(best[token])
        out.append(token)
    return out


got = pretrained.generate_greedy(lm, torch.tensor([[3, 1, 4], [5, 9, 0]]), 4, lengths=[3, 2])
assert got.tolist() == [chain(4, 4), chain(9, 4)], got  # each row from its own last token
print("ok")
