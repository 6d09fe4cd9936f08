"""What capture needs beyond ``torch.export``: input trees, keyword inputs, data-dependent
control flow, shape guards."""
