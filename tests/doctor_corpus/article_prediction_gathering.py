# expect: removed-api@8 wrong-backend@11 removed-api@21 removed-api@22
# "How can prediction results be gathered on a TPU using PyTorch?" (a Q&A article, 2025),
# Example 1 as printed (notebooks 04, 08 correct it; its loader feeds predictions, not training:
# no sampler finding). MyModel, MyDataset, batch_size, num_workers: its placeholders, never run.
# ruff: noqa
import torch
import torch.distributed as dist
import jax.experimental.maps as maps

# Initialize distributed process group (assuming TPU cluster environment is configured)
dist.init_process_group(backend='gloo', init_method='env://') # Replace 'gloo' if necessary

rank = dist.get_rank()
world_size = dist.get_world_size()

# Load model and dataset (assuming these are already prepared for distributed training)
model = MyModel()  # Replace with your model
dataset = MyDataset() # Replace with your dataset

# Assign the model and dataset across TPUs using jax.experimental.maps
model = maps.pmap(model, axis_name='device') # This handles mapping across TPU devices
dataset = maps.pmap(dataset, axis_name='device')

# Prepare data loader
data_loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers)


# Prediction loop
with torch.no_grad():
    for batch in data_loader:
        predictions = model(batch)
        # Process predictions (e.g., gather results, save to file)

#Finalize distributed process group
dist.destroy_process_group()
