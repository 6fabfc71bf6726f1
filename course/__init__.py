"""Course-only code for the notebooks: demo data and model, experiments, figures, the setup
cell. The toolkit users copy is ``tpu_helpers/``; nothing there imports this package."""
