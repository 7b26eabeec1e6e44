import torch, time
torch.set_num_threads(1)
import tracedac
from tests.support.bench_models import llama, DecoderLayer
model, batch = llama(layers=3)
t = time.time()
f = tracedac.peak_trade_off(model, DecoderLayer, lambda m: m(*batch), budgets=4, steps=2, torch_budgets=(0.0, 0.5, 1.0), compile_backend="aot_eager_decomp_partition")
print(f)
print(time.time() - t)
