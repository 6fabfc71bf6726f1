# copies: predict.py ordering.py
# A tiny model over a hand-built padded loader (batches x, index, mask) on XLA:CPU.
import torch
import torch_xla
from predict import predict

n, batch = 7, 4  # 7 rows padded to 2 batches of 4: index -1 / mask False on the last row
x = torch.arange(8.0).reshape(8, 1)
index = torch.tensor([0, 1, 2, 3, 4, 5, 6, -1])
batches = [(x[i:i + batch], index[i:i + batch], index[i:i + batch] >= 0) for i in (0, 4)]
model = torch.nn.Linear(1, 2).to(torch_xla.device())
pred = predict(model, batches, n)
assert pred.index.tolist() == list(range(n)) and pred.padding_rows == 1
expected = model.cpu()(x[:n]).detach().numpy()
assert abs(pred.values - expected).max() < 1e-5 and pred.compiles == 1
print("ok")
