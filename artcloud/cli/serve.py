"""`artcloud serve` (the training + inference server), `artcloud replica` (an inference replica on another node),
`artcloud trainer-node` (the sharded trainer's ranks on another node) and `artcloud pull` (a checkpoint from S3)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

import typer

from artcloud.cli._app import CLIError, app
from artcloud.server.limits import Limits


@app.command()
def serve(
    path: Path = typer.Option(Path("./artcloud-data"), "--path", help="Folder for models, checkpoints and job logs (created if missing)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on. Use 0.0.0.0 on a cloud machine."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port to listen on; 0 picks a free one."),
    tls_cert: Optional[str] = typer.Option(None, "--tls-cert", help="Server certificate (PEM path). Default: $ARTCLOUD_TLS_CERT, else a fresh CA is made under PATH/.tls."),
    tls_key: Optional[str] = typer.Option(None, "--tls-key", help="Private key of --tls-cert (PEM path). Default: $ARTCLOUD_TLS_KEY."),
    token_file: Optional[str] = typer.Option(None, "--token-file", help="File holding the bearer token. Default: $ARTCLOUD_TOKEN, else a new token in PATH/.tls/token."),
    engine: str = typer.Option("cpu", "--engine", help="Model engine: cpu (torch + transformers + peft), vllm (vLLM samples, Unsloth trains; peft where Unsloth cannot load the model), vllm+unsloth, vllm+peft, or auto (vllm when CUDA is present and vLLM and Unsloth import, else cpu; one log line says which and why)."),
    engine_args: Optional[str] = typer.Option(None, "--engine-args", help='JSON object overriding the vLLM engine\'s defaults, e.g. \'{"gpu_memory_utilization": 0.8, "max_model_len": 16384, "load_in_4bit": true}\' (vLLM flags with _ for -, plus the trainer\'s load_in_4bit and max_seq_length, and trainer_gpus: how many GPUs the trainer is sharded over, the rest serving as vLLM replicas; the CPU engine takes max_model_len, max_seq_length, dtype, seed and trainer_procs, and refuses the rest). Default: $ARTCLOUD_ENGINE_ARGS.'),
    vllm_python: Optional[str] = typer.Option(None, "--vllm-python", help="The Python interpreter that runs vLLM (it pins its own torch and transformers, so it may live in another environment). Default: $ARTCLOUD_VLLM_PYTHON, else this one."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
    parent_pid: Optional[int] = typer.Option(None, "--parent-pid", help="Exit when this process is gone (set by LocalBackend)."),
    keep_last: int = typer.Option(0, "--keep-last", min=0, help="Keep only the newest K checkpoints (plus the best, and always the latest), here and on S3. 0 keeps all."),
    keep_best: str = typer.Option("reward_mean", "--keep-best", help="The metric whose best step --keep-last also keeps: a training record's key, or SPLIT/KEY of model.log's (e.g. val/reward)."),
    s3: Optional[str] = typer.Option(None, "--s3", help="Push every checkpoint to s3://BUCKET/PREFIX and resume from it. Default: $ARTCLOUD_S3. Endpoint and credentials: ARTCLOUD_S3_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY."),
    lease: Optional[str] = typer.Option(None, "--lease", help="Exit (after a final checkpoint push) when no authenticated request or heartbeat came for this long: 90s, 15m, 8h (a unit is required). Default: never."),
    behind_https_proxy: bool = typer.Option(False, "--behind-https-proxy", help="Serve plain HTTP to an HTTPS-terminating proxy in front (Modal's encrypted tunnel); the token is still required (from $ARTCLOUD_TOKEN or --token-file). Never on an open port."),
    max_duration: Optional[str] = typer.Option(None, "--max-duration", help="Exit (after a final checkpoint push) this long after start, clients or not: 8h, 1d. Default: never."),
    watch_preemption: bool = typer.Option(False, "--watch-preemption", envvar="ARTCLOUD_WATCH_PREEMPTION", help="On a spot machine: poll the cloud's preemption notice (AWS, GCP, Azure metadata) and, when it comes, push the last checkpoints and exit (SkyBackend(use_spot=True) sets it; the client relaunches and resumes from S3)."),
    preload: Optional[str] = typer.Option(None, "--preload", envvar="ARTCLOUD_PRELOAD", help="Load this base model (a hub id or a folder) while the server comes up, so that GET /health says ready only once it is loaded and the first register finds it loaded. Default: $ARTCLOUD_PRELOAD (SkyBackend and ModalBackend set it when model.register started the sandbox)."),
    replica: list[str] = typer.Option([], "--replica", help="An inference replica on another node (`artcloud replica` there): https://NODE_IP:PORT, repeatable. Rollouts are spread over this server's sampler and the replicas; each committed step is served on all of them. They take $ARTCLOUD_REPLICA_TOKEN where set (a launch gives them their own), else this server's token.", rich_help_panel="Several nodes"),
    trainer_nodes: int = typer.Option(1, "--trainer-nodes", min=1, help="Shard the trainer over this many nodes: this one (node 0, where the server drives it) and the others' `artcloud trainer-node`. The peft trainer (FSDP2) then trains: trainer_procs ranks here on a CPU, one per trainer GPU on CUDA. Needs $ARTCLOUD_TRAINER_KEY, the secret every trainer node holds.", rich_help_panel="Several nodes"),
    trainer_master: Optional[str] = typer.Option(None, "--trainer-master", help="With --trainer-nodes: HOST:PORT where this node's torchrun meets the others (this node's private IP and a free port).", rich_help_panel="Several nodes"),
    replica_ca: Optional[str] = typer.Option(None, "--replica-ca", help="The CA (PEM) that signed the replicas' certificate. Default: the CA this server made under PATH/.tls.", rich_help_panel="Several nodes"),
    s3_claim_timeout: str = typer.Option("15m", "--s3-claim-timeout", help="A model's S3 claim (one server trains it) is renewed every third of this; another server may take the model over after this long without renewal."),
    max_body_mb: float = typer.Option(Limits.max_body_mb, "--max-body-mb", min=0.001, help="Largest request body, in MiB (413 above it).", rich_help_panel="Limits"),
    max_train_bodies: int = typer.Option(Limits.max_train_bodies, "--max-train-bodies", min=1, help="Training request bodies read and parsed at once (429 above it). One over 4 MiB is parsed in a child process, which may take up to ~35x its size in memory for a few seconds.", rich_help_panel="Limits"),
    max_request_tokens: int = typer.Option(Limits.max_request_tokens, "--max-request-tokens", min=1, help="Most tokens one chat request may ask for: n x max_tokens (400 above it).", rich_help_panel="Limits"),
    max_queued_jobs: int = typer.Option(Limits.max_queued_jobs, "--max-queued-jobs", min=1, help="Training jobs that may wait per model (429 above it).", rich_help_panel="Limits"),
    max_queued_samples: int = typer.Option(Limits.max_queued_samples, "--max-queued-samples", min=1, help="Chat samples (n of each request) waiting for or in generation per base model (429 above it).", rich_help_panel="Limits"),
    max_kept_jobs: int = typer.Option(Limits.max_kept_jobs, "--max-kept-jobs", min=1, help="Finished jobs (and their event logs) kept per model; the oldest are forgotten.", rich_help_panel="Limits"),
    max_base_models: int = typer.Option(Limits.max_base_models, "--max-base-models", min=1, help="Base models loaded at once (409 above it): each is a whole engine.", rich_help_panel="Limits"),
    max_models: int = typer.Option(Limits.max_models, "--max-models", min=1, help="Models (LoRA adapters) registered at once (409 above it).", rich_help_panel="Limits"),
) -> None:
    """Serve OpenAI-compatible inference and GRPO training over HTTPS.

    Every route but GET /health needs 'Authorization: Bearer TOKEN'; /health says only status,
    version, readiness and the start-up phase (seconds each took), GET /artcloud/status (with the token) the rest: models, steps, S3, lease,
    limits. Models registered here keep their checkpoints under PATH/PROJECT/MODEL/checkpoints/STEP;
    a restarted server resumes them. On a cloud GPU, --lease and --max-duration make sure it does not
    outlive its client; the Limits bound what one client may ask for.

    Example: artcloud serve --path ./runs --port 8443 --lease 15m --max-duration 8h
    """
    import ssl

    from artcloud.durations import parse_duration
    from artcloud.server.main import ServeError, run
    from artcloud.tls import UnsafeFolder

    try:
        lease_s = parse_duration(lease, what="--lease") if lease is not None else None
        max_duration_s = parse_duration(max_duration, what="--max-duration") if max_duration is not None else None
        claim_timeout_s = parse_duration(s3_claim_timeout, what="--s3-claim-timeout")
    except ValueError as e:
        raise CLIError(str(e)) from e
    parsed_args = _engine_args(engine_args)
    if vllm_python is not None and not (os.path.isfile(vllm_python) and os.access(vllm_python, os.X_OK)):
        raise CLIError(f"--vllm-python {vllm_python}: no executable there; give the path of a python with vllm installed")
    if vllm_python is not None:
        os.environ["ARTCLOUD_VLLM_PYTHON"] = vllm_python
    limits = Limits(max_body_mb=max_body_mb, max_train_bodies=max_train_bodies, max_request_tokens=max_request_tokens, max_queued_jobs=max_queued_jobs,
                    max_queued_samples=max_queued_samples,
                    max_kept_jobs=max_kept_jobs, max_base_models=max_base_models, max_models=max_models)

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("botocore", "boto3", "s3transfer", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        run(host=host, port=port, path=path, tls_cert=tls_cert, tls_key=tls_key, token_file=token_file,
            engine=engine, engine_args=parsed_args, vllm_python=vllm_python, log_level=log_level, parent_pid=parent_pid, s3=s3, keep_last=keep_last, keep_best=keep_best,
            lease_s=lease_s, max_duration_s=max_duration_s, behind_https_proxy=behind_https_proxy, limits=limits,
            claim_timeout_s=claim_timeout_s, watch_preemption=watch_preemption, preload=preload or None,
            replicas=replica, replica_ca=replica_ca, trainer_nodes=trainer_nodes, trainer_master=trainer_master)
    except (ServeError, UnsafeFolder) as e:
        raise CLIError(str(e)) from e
    except ssl.SSLError as e:
        raise CLIError(f"the TLS certificate or key cannot be used ({e.reason or e}): give a matching PEM pair") from e
    except ValueError as e:
        raise CLIError(str(e)) from e


def _engine_args(text: str | None) -> dict | None:
    """--engine-args (default: $ARTCLOUD_ENGINE_ARGS), a JSON object."""
    text = text or os.environ.get("ARTCLOUD_ENGINE_ARGS")
    try:
        parsed = json.loads(text) if text else None
    except json.JSONDecodeError as e:
        raise CLIError(f"--engine-args is not JSON ({e}): give an object, e.g. '{{\"max_model_len\": 4096}}'") from e
    if parsed is not None and not isinstance(parsed, dict):
        raise CLIError("--engine-args must be a JSON object, e.g. '{\"max_model_len\": 4096}'")
    return parsed


@app.command()
def replica(
    path: Path = typer.Option(Path("./artcloud-replica"), "--path", help="Folder for the adapters it serves and its TLS files."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on: the node's private IP in a cluster (never a public one)."),
    port: int = typer.Option(8001, "--port", min=0, max=65535, help="Port to listen on; 0 picks a free one."),
    tls_cert: Optional[str] = typer.Option(None, "--tls-cert", help="The launch's server certificate (PEM path). Default: $ARTCLOUD_TLS_CERT."),
    tls_key: Optional[str] = typer.Option(None, "--tls-key", help="Its private key (PEM path). Default: $ARTCLOUD_TLS_KEY."),
    token_file: Optional[str] = typer.Option(None, "--token-file", help="File holding the launch's bearer token. Default: $ARTCLOUD_TOKEN."),
    engine: str = typer.Option("cpu", "--engine", help="cpu (the torch sampler), vllm (vLLM on every GPU of this node; vllm+peft and vllm+unsloth say the same), or auto (vllm where CUDA is)."),
    head: Optional[str] = typer.Option(None, "--head", help="The head's server, https://HEAD_IP:PORT: once it answered GET /health, the replica stops when it stops answering (3 tries, 10 s apart)."),
    ca: Optional[str] = typer.Option(None, "--ca", help="The launch's CA (PEM) to check --head's certificate with."),
    vllm_python: Optional[str] = typer.Option(None, "--vllm-python", help="The Python that runs vLLM. Default: $ARTCLOUD_VLLM_PYTHON, else this one."),
    engine_args: Optional[str] = typer.Option(None, "--engine-args", help="The operator's engine settings, as the head's --engine-args (a JSON object; a model's own, sent by the head, go over them). Default: $ARTCLOUD_ENGINE_ARGS, which a launch sets on every node."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
) -> None:
    """Serve rollouts for the head node's server (`artcloud serve --replica URL`): an inference replica.

    It loads the head's base model when the head first asks, serves every adapter step the head hands it,
    and generates what the head routes to it. It trains nothing. Every route but /health needs the launch's
    token; run it on the cluster's private network only.

    Example: artcloud replica --host 10.0.0.2 --port 8001 --engine vllm
    """
    import ssl

    from artcloud.server.main import ServeError
    from artcloud.server.replica import serve as serve_replica
    from artcloud.tls import UnsafeFolder

    if engine not in ("cpu", "vllm", "vllm+peft", "vllm+unsloth", "auto"):
        raise CLIError(f"--engine {engine}: a replica runs cpu, vllm or auto")
    if head is not None and not head.startswith("https://"):
        raise CLIError(f"--head {head}: the head's server is reached over HTTPS only (https://HEAD_IP:PORT)")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        serve_replica(host=host, port=port, path=path, tls_cert=tls_cert, tls_key=tls_key, token=None,
                      token_file=token_file, engine=engine, vllm_python=vllm_python, log_level=log_level,
                      head=head, ca=ca, engine_args=_engine_args(engine_args))
    except (ServeError, UnsafeFolder, ValueError) as e:
        raise CLIError(str(e)) from e
    except ssl.SSLError as e:
        raise CLIError(f"the TLS certificate or key cannot be used ({e.reason or e}): give a matching PEM pair") from e


@app.command("trainer-node")
def trainer_node(
    master: str = typer.Option(..., "--master", help="HOST:PORT of the head's rendezvous (the server's --trainer-master)."),
    nodes: int = typer.Option(..., "--nodes", min=2, help="Trainer nodes in all, the head included (the server's --trainer-nodes)."),
    node_rank: int = typer.Option(..., "--node-rank", min=1, help="This node's number among them (the head is 0)."),
    procs: str = typer.Option("auto", "--procs", help="Ranks on this node: a number, or auto (one per GPU; one on a CPU)."),
    device: str = typer.Option("auto", "--device", help="cpu, cuda, or auto (cuda where torch sees a GPU)."),
    head: Optional[str] = typer.Option(None, "--head", help="The head's server, https://HEAD_IP:PORT: once it answered GET /health, this stops when it stops answering."),
    ca: Optional[str] = typer.Option(None, "--ca", help="The launch's CA (PEM) to check --head's certificate with."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
) -> None:
    """Train on this node for the head's server (`artcloud serve --trainer-nodes N --trainer-master HOST:PORT`).

    This node's ranks join every group of the sharded trainer (FSDP2 under torchrun) that the head starts: each
    trains its slice of every step, and a group that ends (a rank died, the server restarted it) is joined
    again. The rendezvous port and the ranks' traffic stay on the cluster's private network. $ARTCLOUD_TRAINER_KEY
    must hold the head's trainer key (SkyBackend sets it on every trainer node): the ranks prove it to each other.

    Example: artcloud trainer-node --master 10.0.0.1:29500 --nodes 2 --node-rank 1 --head https://10.0.0.1:8080
    """
    import threading

    from artcloud.server.engines.children import KEY_ENV, Rendezvous

    if nodes <= node_rank:
        raise CLIError(f"--node-rank {node_rank} is not below --nodes {nodes}: the nodes are 0 (the head) to {nodes - 1}")
    if device not in ("auto", "cpu", "cuda") or not (procs == "auto" or procs.isdigit() and int(procs) >= 1):
        raise CLIError("--device is cpu, cuda or auto, and --procs a number (1 or more) or auto")
    if head is not None and not head.startswith("https://"):
        raise CLIError(f"--head {head}: the head's server is reached over HTTPS only (https://HEAD_IP:PORT)")
    try:
        rendezvous = Rendezvous(nodes, master, os.environ.get(KEY_ENV, ""))
    except ValueError as e:
        if getattr(e, "field", None) == KEY_ENV:
            raise CLIError(str(e)) from e
        raise CLIError(f"--master {master}: give HOST:PORT, the server's --trainer-master") from e
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    from artcloud.server.engines.sharded import follow
    from artcloud.server.replica import watch_head

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    count = int(procs) if procs != "auto" else (torch.cuda.device_count() if device == "cuda" else 1)
    stop = threading.Event()
    if head:
        watch_head(head, ca, stop.set)
    try:
        follow(rendezvous, node_rank, count, device, stop)
    except KeyboardInterrupt:
        stop.set()


@app.command()
def pull(
    target: str = typer.Argument(..., help="The model, as PROJECT/MODEL."),
    step: str = typer.Option("latest", "--step", help="A step number, or 'latest' (the newest committed one)."),
    to: Optional[Path] = typer.Option(None, "--to", help="Folder to pull into; the checkpoint lands in TO/STEP. Default: ./checkpoints/PROJECT/MODEL."),
    keep_last: int = typer.Option(0, "--keep-last", min=0, help="Keep only the newest K checkpoints (plus the best, and always the latest), here and on S3. 0 keeps all."),
    keep_best: str = typer.Option("reward_mean", "--keep-best", help="The metric whose best step --keep-last also keeps: a training record's key, or SPLIT/KEY of model.log's (e.g. val/reward)."),
    s3: Optional[str] = typer.Option(None, "--s3", help="Where the checkpoints are: s3://BUCKET/PREFIX. Default: $ARTCLOUD_S3."),
) -> None:
    """Download a checkpoint from S3, verified against its manifest.

    The folder loads with peft as it is: PeftModel.from_pretrained(base_model, FOLDER).

    Example: artcloud pull mail/agent-1 --s3 s3://my-bucket/runs --to ./agent-1
    """
    from artcloud.storage.checkpoints import CorruptCheckpoint
    from artcloud.storage.s3 import StorageError, pull_checkpoint

    if step != "latest" and not step.isdigit():
        raise CLIError(f"--step takes a step number or 'latest', not {step!r}")
    try:
        folder = pull_checkpoint(target, s3=s3, step=None if step == "latest" else int(step), to=to)
    except (StorageError, CorruptCheckpoint) as e:
        raise CLIError(str(e)) from e
    print(f"pulled {target} step {folder.name} into {folder}")
