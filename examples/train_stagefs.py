"""A tiny model trained for a few steps on a mount's image view with stagefs.Loader.

    stagefs mount /bigdata/raw $SCRATCH/data --cache $SCRATCH/cache --image-size 64
    python examples/train_stagefs.py $SCRATCH/data/.npy/images/train --steps 20

The view's images.npy (uint8 [N, S, S, 3], decoded and resized by the mount) and labels.npy are
read by stagefs.Loader's threads into a ring of batches; each batch arrives as torch tensors,
already on the GPU with --device cuda:0, without a copy. Under DDP pass rank/world_size (as
DistributedSampler) and call set_epoch each epoch.
"""

import argparse
import time

import torch

import stagefs


def tiny_model(classes):
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, classes),
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("view", help="a .npy view directory of an image folder (MNT/.npy/<dir>)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    classes = len(open(f"{args.view}/classes.txt").read().split())
    loader = stagefs.Loader([f"{args.view}/images.npy", f"{args.view}/labels.npy"], args.batch_size,
                            shuffle=True, seed=0, drop_last=False, device=args.device)
    model = tiny_model(classes).to(args.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # uint8 NHWC -> float NCHW, normalised: on the device, right before the model.
    mean = torch.tensor([0.485, 0.456, 0.406], device=args.device).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=args.device).view(1, 3, 1, 1) * 255
    step, epoch, start = 0, 0, time.perf_counter()
    while step < args.steps:
        loader.set_epoch(epoch)
        for images, labels in loader:
            x = (images.permute(0, 3, 1, 2).float() - mean) / std
            loss = torch.nn.functional.cross_entropy(model(x), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % 5 == 0 or step == args.steps:
                print(f"step {step:3d}  epoch {epoch}  loss {loss.item():.3f}")
            if step == args.steps:
                break
        epoch += 1
    s = loader.stats()
    print(f"{step} steps in {time.perf_counter() - start:.1f} s; the loop waited on data "
          f"{100 * s['device_wait_share']:.0f}% of the time ({s['verdict']})")


if __name__ == "__main__":
    main()
