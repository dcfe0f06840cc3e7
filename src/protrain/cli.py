"""`protrain` command line: train, plan, profile, preprocess, inspect-data, convert-checkpoint,
merge-lora.

Mistakes in the user's input (config, data, output directory) and every file or OS error
(a path that cannot be read or written, a full disk, text that is not UTF-8) are printed as
one line starting with `error:` and exit with status 2; `--debug` (or PROTRAIN_DEBUG=1)
shows their traceback instead. Anything else is a bug and keeps its traceback.

Under `torchrun`, a rank whose collective fails because another rank failed or was killed
prints one line for its node (`train/rank_failure.py`: which rank, what happened, the
newest intact checkpoint and the command that resumes) instead of the collective's
traceback, and exits with status 3.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from protrain.runtime.allocator import prefer_expandable_segments
from protrain.train.errors import ConfigError, OutputDirError
from protrain.train.log import setup_logging

EXIT_USER_ERROR = 2
EXIT_OTHER_RANK_FAILED = 3


def _version() -> str:
    try:
        return version("protrain")
    except PackageNotFoundError:
        return "unknown"


def _user_errors() -> tuple[type[BaseException], ...]:
    # CLI start-up time: the app (torch) loads on use
    from protrain.train.data import DataError

    return (ConfigError, DataError, OutputDirError)


def _at_least_one(text: str) -> int:
    """argparse type: a whole number of at least 1 (argparse prints the message in one line)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed: at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="protrain", description="Memory-aware fine-tuning of LLMs and VLMs."
    )
    parser.add_argument("--version", action="version", version=f"protrain {_version()}")
    debug_help = "show the traceback of an error instead of one line (or PROTRAIN_DEBUG=1)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_config_args(p: argparse.ArgumentParser) -> None:
        # After the command too; SUPPRESS keeps a `--debug` given before it.
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
        p.add_argument(
            "config",
            nargs="?",
            default=None,
            help="YAML config; without one, the embedded quickstart",
        )
        p.add_argument(
            "--set",
            dest="overrides",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config key, e.g. --set learning_rate=1e-4 --set model.dtype=bfloat16",
        )

    p_train = sub.add_parser("train", help="train a model from a YAML config")
    add_config_args(p_train)
    p_train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in output_dir",
    )
    p_train.add_argument(
        "--new-global-batch",
        action="store_true",
        help="with --resume: continue although the rows per optimizer step (micro_batch_size "
        "x gradient_accumulation_steps x ranks) differ from the checkpoint's; the data "
        "continues where it stopped, the schedule is recomputed for the steps left",
    )
    p_train.add_argument(
        "--accept-changed-inputs",
        action="store_true",
        help="with --resume: continue although a frozen input (the base model's files, an "
        "adapter.extra[].path loaded frozen) differs from the files the checkpoint was "
        "trained with; the run goes on with them as they are now",
    )

    p_plan = sub.add_parser(
        "plan",
        help="profile one step and print the memory plan and its best candidates; with "
        "fsdp_version: 2, the FSDP2 engine's measured peak per rank",
    )
    add_config_args(p_plan)
    p_plan.add_argument(
        "--gpu-budget",
        default=None,
        metavar="SIZE",
        help="the chunk engine's plan at this device memory per rank, e.g. 24GiB (as --set "
        "memory.auto=true --set memory.gpu_budget=SIZE); with fsdp_version: 2, printed after "
        "the FSDP2 engine's peak, so that the two can be compared",
    )

    p_profile = sub.add_parser(
        "profile", help="profile one step and write a picture of its memory over time"
    )
    add_config_args(p_profile)
    p_profile.add_argument(
        "--out",
        default="protrain-profile.html",
        metavar="PATH",
        help="where to write the picture: HTML, or PNG when PATH ends in .png "
        "(default: protrain-profile.html)",
    )

    p_pre = sub.add_parser("preprocess", help="tokenize the datasets and cache them")
    add_config_args(p_pre)

    p_inspect = sub.add_parser(
        "inspect-data", help="print rendered samples with the trained tokens marked"
    )
    add_config_args(p_inspect)
    p_inspect.add_argument("-n", "--num-samples", type=_at_least_one, default=3)
    p_inspect.add_argument("--color", action="store_true", help="mark trained tokens in colour")

    p_convert = sub.add_parser(
        "convert-checkpoint",
        help="write a checkpoint in the other format (sharded <-> one-process)",
    )
    p_convert.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help
    )
    p_convert.add_argument("checkpoint", help="a checkpoint-<step> folder")
    p_convert.add_argument("output_dir", help="where checkpoint-<step> is written")

    p_merge = sub.add_parser(
        "merge-lora",
        help="merge a trained LoRA/DoRA adapter into its base; write a plain Hugging Face model",
    )
    p_merge.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    p_merge.add_argument("adapter", help="the adapter directory (a run's final/)")
    p_merge.add_argument("output_dir", help="where the merged model is written")
    p_merge.add_argument(
        "--base",
        default=None,
        metavar="PATH_OR_ID",
        help="the base model (default: final/base_model of a tiny run, else the adapter's "
        "base_model_name_or_path)",
    )
    p_merge.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="the dtype the merge is computed and written in (default: the base's own)",
    )
    p_merge.add_argument("--force", action="store_true", help="replace output_dir if it exists")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("PROTRAIN_DEBUG", "") not in ("", "0")

    prefer_expandable_segments()  # before anything touches CUDA
    quiet_third_party_noise()  # before anything imports bitsandbytes
    from protrain.train import rank_failure  # CLI start-up time: the app loads on use

    rank_failure.begin_run()  # an error names only this command's checkpoints
    try:
        return _run(args)
    except _user_errors() as exc:
        if debug:
            raise
        return _error(str(exc), exc)
    except UnicodeDecodeError as exc:  # the readers name their file; this one was not caught
        if debug:
            raise
        return _error(f"a file is not UTF-8 text ({exc}); --debug shows which", exc)
    except OSError as exc:
        if debug:
            raise
        return _error(os_error_line(exc), exc)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        return _other_rank_failed(exc, debug)


def _error(message: str, exc: BaseException) -> int:
    # CLI start-up time: the app (torch) loads on use
    from protrain.train import rank_failure

    rank_failure.record_failure(message)
    # Under several ranks the line names the newest checkpoint and the resume command
    # (the launcher's output is all a node shows); one process's errors name what to do.
    kept = rank_failure.what_is_kept() if _several_ranks() and "--resume" not in message else ""
    if _reports(exc):
        own = (
            ""
            if getattr(exc, "protrain_agreed", False) or not _several_ranks()
            else (f" (rank {os.environ.get('RANK', '0')})")
        )
        print(f"error: {message}{own}" + (f"; {kept}" if kept else ""), file=sys.stderr)
    return EXIT_USER_ERROR


def _several_ranks() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def _other_rank_failed(exc: Exception, debug: bool) -> int:
    """A collective that failed because another rank failed or died: one line for this
    node, no traceback. Any other error is this rank's own: recorded for the other
    ranks, and raised with its traceback."""
    # CLI start-up time: the app (torch) loads on use
    from protrain.train import rank_failure

    if not _several_ranks():
        raise exc
    # torchrun stops the other ranks with SIGTERM as soon as one has ended: this rank is
    # ending anyway, and its line must not be cut off
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    peer = rank_failure.peer_failure()
    if peer is None or debug:
        rank_failure.record_failure(f"{type(exc).__name__}: {exc}")
        raise exc
    if peer.prints_here:
        print(f"error: {peer.line}", file=sys.stderr, flush=True)
    return EXIT_OTHER_RANK_FAILED


def _reports(exc: BaseException) -> bool:
    """Whether this process prints ``exc``. Under `torchrun` an error that every rank has
    alike is printed once a node, by its local rank 0: one raised before the ranks were
    started (every rank read the same config and files), rank 0's, agreed to every rank, or
    one every rank raises alike from the same check (``agreed`` / ``alike`` in
    ``distributed/agree.py``). Any other error is this rank's own and always printed."""
    # CLI start-up time: the app (torch) loads on use
    from protrain.train.ranks import joined_ranks

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or os.environ.get("LOCAL_RANK", "0") == "0":
        return True
    return not (getattr(exc, "protrain_agreed", False) or not joined_ranks())


def os_error_line(exc: OSError) -> str:
    """`PATH: what went wrong`, as the shell says it; without a path, what went wrong."""
    what = exc.strerror or " ".join(str(exc).split()) or type(exc).__name__
    if exc.filename is None:
        return f"{what} (--debug shows where)"
    paths = repr(str(exc.filename))
    if exc.filename2 is not None:
        paths += f" -> {str(exc.filename2)!r}"
    return f"{paths}: {what}"


# bitsandbytes logs this at import on CPUs with AVX512-BF16 when the optional `kernels`
# package (a faster CPU 4-bit matmul, fetched from the hub) is missing; it falls back to its
# own kernel, so the warning asks nothing of our users.
_BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
_BNB_KERNELS_WARNING = "Failed to load CPU gemm_4bit_forward from kernels-community"


class _DropBitsandbytesKernelsWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_BNB_KERNELS_WARNING)


def quiet_third_party_noise() -> None:
    """Drop the one import-time warning of bitsandbytes about its optional `kernels`
    package; everything else it logs is kept."""
    bnb = logging.getLogger(_BNB_CPU_LOGGER)
    if not any(isinstance(f, _DropBitsandbytesKernelsWarning) for f in bnb.filters):
        bnb.addFilter(_DropBitsandbytesKernelsWarning())


class _DropPlanRecord(logging.Filter):
    """`protrain plan` prints the plan on stdout; the planner's log record of the same plan
    would show it twice."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("protrain plan in ")


def _check_recorded_config(cfg) -> None:
    """`--resume` compares the run with the config it recorded: a damaged record is named
    here, before any data or model is loaded."""
    # CLI start-up time: the app (torch) loads on use
    from protrain.train.config import read_yaml_mapping

    path = Path(cfg.output_dir) / "config.yaml"
    if not path.exists():
        return
    try:
        read_yaml_mapping(path, what="the run's recorded config")
    except ConfigError as exc:
        raise OutputDirError(
            f"--resume: {exc}; restore it, or delete it to record this run's config instead"
        ) from None


def _sdpa(cfg):
    # CLI start-up time: the app (torch) loads on use
    from protrain.train.attention import sdpa_backend
    from protrain.train.modeling import resolve_device

    return sdpa_backend(cfg.model.sdpa_backend, resolve_device(cfg.device))


def _chunk_plan_keys(gpu_budget: str) -> list[str]:
    """Overrides that turn a config into the chunk engine's, planned at ``gpu_budget``."""
    return [
        "fsdp_version=null",
        "fsdp_config=null",
        "memory.auto=true",
        f"memory.gpu_budget={gpu_budget}",
    ]


def _print_chunk_plan(cfg, is_main: bool) -> None:
    # CLI start-up time: the app (torch) loads on use
    from protrain.plan import candidates_table, explain
    from protrain.train.planning import plan_memory, planning_inputs

    model, batch, settings = planning_inputs(cfg)
    planner_log = logging.getLogger("protrain.plan.auto")
    drop = _DropPlanRecord()
    planner_log.addFilter(drop)
    try:
        with _sdpa(cfg):  # the trace runs attention as training will
            plan, _ = plan_memory(model, batch, settings)
    finally:
        planner_log.removeFilter(drop)
    if is_main:
        print(explain(plan, with_candidates=False))
        print("best candidates:")
        print(candidates_table(plan))


def _print_fsdp2_peak(cfg, device, is_main: bool) -> None:
    """Every rank traces two real steps of the FSDP2 engine on its own; rank 0 prints the
    largest peak of any rank (`train/fsdp2_trace.py`)."""
    # CLI start-up time: the app (torch) loads on use
    from protrain.train.fsdp2_trace import fsdp2_inputs, largest_over_ranks, measure_fsdp2_peak

    log = logging.getLogger("protrain")
    level = log.level
    if not is_main:  # rank 0 logs for the job, as in training
        log.setLevel(logging.WARNING)
    try:
        model, batch, autocast_dtype = fsdp2_inputs(cfg, device)
        with _sdpa(cfg):
            # the model was built for the trace alone: it is sharded and trained, not copied
            peak = measure_fsdp2_peak(model, batch, cfg, device, autocast_dtype, copy_model=False)
        del model
    finally:
        log.setLevel(level)
    peak = largest_over_ranks(peak, device)
    if is_main:
        print(peak.describe(), flush=True)


def _run(args: argparse.Namespace) -> int:
    # CLI start-up time: each command loads the app (torch) on use (here and below)
    from protrain.train.config import load_config

    setup_logging()
    if args.command == "convert-checkpoint":  # no config: the checkpoint says it all
        from protrain.train.checkpoint.convert import convert_checkpoint

        path = convert_checkpoint(Path(args.checkpoint), Path(args.output_dir))
        print(f"converted: {path}")
        return 0
    if args.command == "merge-lora":  # no config: the adapter folder names its base
        from protrain.train.merge_lora import merge_lora

        merged = merge_lora(
            Path(args.adapter), Path(args.output_dir), base=args.base, dtype=args.dtype,
            force=args.force,
        )  # fmt: skip
        print(f"merged model written to {merged}")
        return 0
    cfg = load_config(args.config, args.overrides)
    if args.command == "train":
        from protrain.train.loop import train

        for flag, given in (
            ("--new-global-batch", args.new_global_batch),
            ("--accept-changed-inputs", args.accept_changed_inputs),
        ):
            if given and not args.resume:
                raise ConfigError(f"{flag} is allowed only with --resume")
        if args.resume:
            _check_recorded_config(cfg)

        result = train(
            cfg,
            resume=args.resume,
            new_global_batch=args.new_global_batch,
            accept_changed_inputs=args.accept_changed_inputs,
        )
        if os.environ.get("RANK", "0") == "0":  # torchrun: rank 0 speaks for the job
            print(f"done: {result.steps} steps; model written to {result.final_dir}")
        return 0

    if args.command == "plan":
        from protrain.train.modeling import resolve_device
        from protrain.train.ranks import start_ranks, stop_ranks

        # under torchrun: every rank measures the hardware with the others, the first
        # traces and searches, and prints the plan each rank will run
        chunk_cfg = cfg if cfg.fsdp is None else None
        if args.gpu_budget is not None:  # the chunk engine's plan at that budget
            try:
                chunk_cfg = load_config(
                    args.config, args.overrides + _chunk_plan_keys(args.gpu_budget)
                )
            except ConfigError as exc:
                raise ConfigError(
                    f"--gpu-budget {args.gpu_budget}: {exc} (a size such as 24GiB)"
                ) from None
        ranks, device = start_ranks(resolve_device(cfg.device))
        if cfg.fsdp is not None:
            _print_fsdp2_peak(cfg, device, ranks.is_main)
        if chunk_cfg is not None:
            _print_chunk_plan(chunk_cfg, ranks.is_main)
        stop_ranks()
        return 0
    if args.command == "profile":
        from protrain.profile.hardware import measure_hardware
        from protrain.profile.timeline import write_timeline_html, write_timeline_png
        from protrain.train.planning import planning_inputs, profile_memory

        model, batch, settings = planning_inputs(cfg)
        with _sdpa(cfg):
            profile = profile_memory(model, batch, settings)
        # the budget line, and the host AdamW lane at this machine's measured rates (cached)
        picture = dict(
            budget_bytes=settings.request.gpu_budget_bytes,
            hardware=measure_hardware(settings.device),
            clipping=settings.request.clipping,
        )
        title = f"{cfg.model.name_or_path}, batch {cfg.micro_batch_size} x {cfg.sequence_len}"
        if args.out.lower().endswith(".png"):
            path = write_timeline_png(profile, args.out, **picture)
        else:
            path = write_timeline_html(profile, args.out, title=title, **picture)
        print(f"profile of one step written to {path}")
        return 0

    from protrain.train.modeling import load_media_processor, load_tokenizer

    tokenizer = load_tokenizer(cfg)
    processor = load_media_processor(cfg)  # a vision-language model's, as train reads rows
    if args.command == "preprocess":
        from protrain.train.data import preprocess

        path = preprocess(
            cfg,
            tokenizer,
            sequence_len=cfg.sequence_len,
            seed=cfg.seed,
            output_path=cfg.dataset_prepared_path,
            processor=processor,
        )
        print(f"tokenized datasets written to {path}")
        return 0
    if args.command == "inspect-data":
        from protrain.train.data import render_inspection

        print(
            render_inspection(
                cfg,
                tokenizer,
                sequence_len=cfg.sequence_len,
                n_samples=args.num_samples,
                color=args.color,
                processor=processor,
            )
        )
        return 0
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
