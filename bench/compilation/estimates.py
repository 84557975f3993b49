r"""Per-chip memory and roofline time of the pod-scale jobs, from the compilers.

  python -m bench.compilation.estimates            # print the tables
  python -m bench.compilation.estimates --write    # and put them in BENCHMARKS.md
  python -m bench.compilation.estimates --only='LM 1b'
  python -m bench.compilation.estimates --reuse --write  # rows compiled before

Each row is one `python -m launch.compile` run (a process of its own) of a
job users take to a pod or a GPU node, on a TPU v5e pod (v5e:16x16, 256
chips) and a node of 8 H100s (h100:1x1x8), with the layout that fits
there (the overrides column): the LMs of configs/lm.py `size=`, with and
without SAM; the SAM paper's WRN-28-10 on CIFAR-10 and ResNet-50 on
ImageNet, SAM against the base step; GRPO with the 1b policy on a pod
split into rollout and learner meshes; steering generation on the 1b LM.
Every figure is the compiler's estimate (memory analysis; FLOPs and HBM
bytes from its cost model; roofline = max(FLOPs / peak, bytes /
bandwidth)), never a measured time: nothing here ran on a TPU or GPU.
Each row's compile.json is kept under --workdir, in a folder named by its
command; `--reuse` takes it from there instead of compiling again. The
jobs and the section's text are here; running and tabulating them is
`train.compilation.estimates`.
"""

from absl import app
from absl import flags

from bench import report
from train.compilation import estimates
from train.compilation.estimates import Job

_WRITE = flags.DEFINE_bool('write', False, 'Write the tables to BENCHMARKS.md.')
_ONLY = flags.DEFINE_string('only', None, 'Run only rows whose name starts so.')
_WORKDIR = flags.DEFINE_string('workdir', '/tmp/geom_compile_estimates',
                               'Where each row writes its compile.json.')
_TABLE = flags.DEFINE_enum(
    'table', 'pods', ['pods', 'gemma'], 'Which table: the pod-scale jobs, '
    'or Gemma 3 fine-tuning (270M to 4B) on a few chips.')
_REUSE = flags.DEFINE_bool(
    'reuse', False, 'Take a row\'s compile.json from --workdir when it is '
    'there (from an earlier run of the same command) instead of compiling.')

POD, NODE = 'v5e:16x16', 'h100:1x1x8'
SAM_ENABLED = 'optimizer.sam.enabled'
# A GPU node holds fewer chips than a pod: smaller global batches there,
# and the 8b model split over 4 GPUs by tensor parallelism.
JOBS = [
    *[Job(f'LM {size}{" + SAM" if sam else ""}', f'configs/lm.py:size={size}',
          None, target, {**({SAM_ENABLED: True} if sam else {}), **extra})
      for size, node in (('125m', {'batch_size': 64, 'eval_batch_size': 64}),
                         ('1b', {'batch_size': 32, 'eval_batch_size': 32}),
                         ('8b', {'batch_size': 16, 'eval_batch_size': 16}))
      for target, extra in ((POD, {}), (NODE, node))
      for sam in (False, True)],
    Job('LM 8b', 'configs/lm.py:size=8b', None, 'v5e:2x2', {}),
    *[Job(f'{name}{" + SAM" if sam else ""}', config, None, target,
          {**extra, SAM_ENABLED: sam})
      for name, config in (('WRN-28-10 CIFAR-10', 'configs/wrn_cifar10.py'),
                           ('ResNet-50 ImageNet',
                            'configs/resnet50_imagenet.py'))
      for target, extra in ((POD, {}), (NODE, {}))
      for sam in (False, True)],
    Job('GRPO 1b', 'configs/rl.py:size=1b', 'configs/rl_sft.py:size=1b', POD,
        {}),
    Job('GRPO 1b', 'configs/rl.py:size=1b', 'configs/rl_sft.py:size=1b', NODE,
        {'rollout_devices': 4}),
    Job('Steering 1b', 'configs/steering.py', 'configs/lm.py:size=1b', POD,
        {}),
    Job('Steering 1b', 'configs/steering.py', 'configs/lm.py:size=1b', NODE,
        {}),
]


# Gemma 3 fine-tuning (configs/gemma.py:finetune; 1b and 4b in bfloat16
# compute with float32 parameters and remat), on the fewest chips that
# hold it: its own table (`--table=gemma`).
GEMMA_JOBS = [
    Job('Gemma 3 270m fine-tune', 'configs/gemma.py:finetune', None,
        'v5e:1x1', {}),
    Job('Gemma 3 270m fine-tune', 'configs/gemma.py:finetune', None,
        'h100:1x1x1', {}),
    Job('Gemma 3 1b fine-tune', 'configs/gemma.py:finetune,shape=1b', None,
        'v5e:2x2', {}),
    Job('Gemma 3 1b fine-tune', 'configs/gemma.py:finetune,shape=1b', None,
        'h100:1x1x1', {}),
    *[Job(f'Gemma 3 4b fine-tune{" + SAM" if sam else ""}',
          'configs/gemma.py:finetune,shape=4b', None, target,
          {SAM_ENABLED: sam})
      for target in ('v5e:4x4', 'h100:1x1x8') for sam in (False, True)],
    Job('Gemma 3 4b fine-tune, frozen embedding',
        'configs/gemma.py:finetune,shape=4b', None, 'h100:1x1x1',
        {'optimizer.frozen': '^embedding$'}),
]


def main(argv):
  del argv
  jobs = [job for job in (GEMMA_JOBS if _TABLE.value == 'gemma' else JOBS)
          if not _ONLY.value or job.name.startswith(_ONLY.value)]
  done = []
  for job in jobs:
    result, error, seconds = estimates.compile_job(
        job, estimates.job_workdir(_WORKDIR.value, job), _REUSE.value)
    print(f'{job.name} on {job.target}: {seconds:.0f} s'
          + (f' ({error})' if error else ''), flush=True)
    done.append(estimates.Estimate(job, result, error))
  if _TABLE.value == 'gemma':
    report.publish('compile_estimates_gemma', gemma_lines(jobs, done),
                   _WRITE.value)
  else:
    report.publish('compile_estimates', pod_lines(jobs, done), _WRITE.value)


def _tables(done) -> list[str]:
  """The jobs' programs, then SAM's train step against the base step."""
  return ['', *estimates.table(done, hidden=(SAM_ENABLED,)), '',
          'SAM against the base step (train step only):', '',
          *estimates.ratios(done, ' + SAM', 'SAM'), '']


def pod_lines(jobs, done) -> list[str]:
  return [
      '## Estimated from the compiler (not measured): pod-scale jobs',
      '',
      'Per-chip memory and roofline time of each job\'s programs as the '
      'TPU compiler (libtpu 0.0.42) and the GPU compiler (jax-cuda12-plugin '
      '0.10.2, no autotuning) plan them for a v5e pod (v5e:16x16, 256 chips, '
      '15.75 GiB usable each) and a node of 8 H100s (h100:1x1x8, 59.3 GiB '
      'each: 80 GB x JAX\'s 0.75 preallocation). Roofline = max(FLOPs / '
      'peak bf16, HBM bytes / bandwidth) per chip from the datasheets: a '
      'lower bound that ignores collectives and overlap. Nothing here ran '
      'on a TPU or GPU. Reproduce: `python -m bench.compilation.estimates '
      '--write`; one row: the `launch.compile` command below it.',
      *_tables(done),
      'GRPO 1b on one v5e slice does not compile (row above, as of this '
      'libtpu): its rollout mesh holds 128 of the slice\'s 256 chips, and on '
      'v5e (limited ICI routing) the TPU compiler wants a program to span '
      'the whole slice. The rollout and the learner need a slice each '
      'there; with `--num_slices=2 --config.rollout_devices=256` the rollout '
      'compiled (5.54 GiB/chip) but the learner update did not '
      '("INVALID_ARGUMENT: Slice is empty"): open. On 8 H100s the split '
      'compiles.', '',
      'Commands:', '',
      *estimates.commands(jobs),
  ]


def gemma_lines(jobs, done) -> list[str]:
  return [
      '## Estimated from the compiler (not measured): Gemma 3 fine-tuning',
      '',
      'The train, eval and finiteness-check programs of `launch.train '
      '--config=configs/gemma.py:finetune` (batches of 16 windows of 65 '
      'tokens for 270M, 64 for 1B and 4B; AdamW, float32 parameters and '
      'moments; 1B '
      'and 4B compute in bfloat16 with every block rematerialised), FSDP '
      'over the chips (`decoder_blocks.SIZE_RULES`), as the TPU compiler '
      '(libtpu 0.0.42) and the GPU compiler (jax-cuda12-plugin 0.10.2, no '
      'autotuning) plan them on the fewest chips that hold each. Shapes '
      'only: 1B and 4B weights ship in no registry package. Roofline as '
      'in the pod-scale table; nothing here ran on a TPU or GPU. '
      'Reproduce: `python -m bench.compilation.estimates --table=gemma '
      '--write`.',
      *_tables(done),
      'Commands:', '',
      *estimates.commands(jobs),
  ]


if __name__ == '__main__':
  app.run(main)
