"""One model call over several processes (GPUs of one host), each process holding its own copy of the model: the
call's batch split between them (`batch_split.py`; with classifier-free guidance the batch is the conditional and the
unconditional pass, so two processes run one each: CFG parallelism), or its tokens (`sequence_split.py`: every process
runs the whole call on its share of the tokens, attention trading tokens for heads: Ulysses). Communication is
torch.distributed (NCCL on GPUs, gloo on the CPU); the processes are started and supervised with
torch.multiprocessing (`workers.py`)."""
