"""The text of `kdist launch --help` after the options (argparse epilog)."""

LAUNCH_EPILOG = """\
examples:
  # 4 processes on this host with torchrun's variables (RANK, WORLD_SIZE, ...):
  kdist launch --nproc 4 train.py --epochs 3
  kdist launch --nproc 2 -m mypackage.train

  # the tasks of a multi-host TF_CONFIG cluster that run on this host:
  kdist launch --cluster cluster.json --task worker:1 --task ps:0 train.py
  #   cluster.json: {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"], "ps": ["10.0.0.2:2223"]}
  #   (or a whole TF_CONFIG object; its "cluster" key is used)

  # a whole parameter-server cluster on this host, every task on a free port:
  kdist launch --workers 2 --ps 2 --chief train.py
  # a TF_CONFIG cluster for MultiWorkerMirroredStrategy on this host:
  kdist launch --workers 2 --chief train.py

environment of each process:
  --nproc:    RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK=0,
              GROUP_WORLD_SIZE=1, ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME=default,
              MASTER_ADDR, MASTER_PORT; TF_CONFIG is removed.
  TF_CONFIG modes: TF_CONFIG={"cluster": ..., "task": {"type": T, "index": I}};
              the torchrun variables are removed.
  always:     KDIST_LAUNCHER=1, PYTHONUNBUFFERED=1, PYTHONFAULTHANDLER=1, and
              OMP_NUM_THREADS = cores / processes unless OMP_NUM_THREADS is set.
  secret:     KDIST_SECRET_FILE=<path of a file holding a fresh per-job secret>;
              the servers and clients of the job authenticate each other with it.
              The file is readable by you only (0600, in a 0700 directory), is
              never on a command line, and is removed when the launcher exits.
              If KDIST_SECRET_FILE or KDIST_SECRET is already set (one secret for
              a multi-host cluster), it is passed through and nothing is made;
              --cluster with tasks on other hosts makes none either.

output and exit:
  Each line a process writes is printed with its name: "[worker-1] loss: 0.3",
  and written to DIR/<name>.log (--log-dir; by default a new kdist-launch-*
  directory in the temporary directory, removed when the job succeeds).
  When a process fails, the others get --grace seconds to finish; then the stacks
  of the survivors are printed (SIGABRT, faulthandler) and they are killed. After
  the first failure only its output and those stacks are printed; the others'
  output (their consequent errors) goes to their logs only. At the end the
  launcher names the first failure and its exception, then each other failed
  process in one line with its exception and log file. The exit code is the
  first failing process's (128 + N if signal N killed it), 0 if none failed,
  124 on --timeout. Ctrl-C, SIGTERM or SIGHUP sends SIGTERM to every
  process, SIGKILL after --grace seconds, and exits 130 (SIGINT), 143 (SIGTERM) or
  129 (SIGHUP); a second Ctrl-C kills at once. Processes die with the launcher (Linux).
  Daemon jobs (default: ps with --workers, none with --cluster) serve until
  stopped: they get SIGTERM once every other process ended, and their exit codes
  then do not count.

coordinator training (--chief with --ps):
  The chief is the coordinator and the workers only serve. A worker that dies is
  not the job's failure: the chief moves its work to the other workers, and the
  launcher starts it again with the same TF_CONFIG and port after 1s, 2s, 4s...,
  up to --max-worker-restarts times (default 3; 0 = a worker's death fails the
  job). Each restart is logged: "[kdist] worker-1 (pid N) was killed by SIGKILL;
  restarting it (1 of 3) in 1s". The chief decides the outcome: the exit code is
  the chief's. A worker that fails again after its last restart fails the job.

parameter servers and trainers that come back (--ps):
  Each ps checkpoints itself every --ps-checkpoint-every (N applied pushes, "1" =
  every step, or "30s"; default 60s) into --ps-checkpoint-dir/ps-I (default: the
  log directory). A ps that dies is started again on its port, restores that
  checkpoint and the others carry on; up to --max-ps-restarts times (default 3;
  0 = a ps's death fails the job). Updates applied after its last checkpoint are
  lost and logged. --max-restarts K restarts the process that trains alone: the
  chief (coordinator training) or each worker (without --chief), up to K times;
  its fit resumes from the script's BackupAndRestore while the servers keep theirs.

restarting a synchronous job (--max-restarts K, with --nproc, or --workers without --ps):
  When a process fails (a non-zero exit, a signal), the launcher restarts the whole
  job, up to K times (default 0: the failure ends the job): it logs
  "[kdist] worker-1 (pid N) was killed by SIGKILL; restarting the job (1 of K)",
  stops every other process (SIGTERM, SIGKILL after 10s; no stack dumps), and
  once all ended (1s later, then 2s, 4s...) starts every process again on a new
  rendezvous port (--master-port, if given, is kept). The script runs again from
  the start: a keras.callbacks.BackupAndRestore in its fit resumes from the last
  backup. A failure after the K-th restart fails the job as above. Each process's
  log file holds the output of every run. Under torchrun, use torchrun's own
  --max-restarts: torchrun restarts the processes and fit resumes the same way.
"""
