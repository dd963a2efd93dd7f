"""One model call over several processes (GPUs of one host): the call's batch split between them, each process
holding its own copy of the model. With classifier-free guidance the batch is the conditional and the unconditional
pass, so two processes run one each (CFG parallelism). Communication is torch.distributed (NCCL on GPUs, gloo on the
CPU); the processes are started and supervised with torch.multiprocessing (`workers.py`)."""
