"""The same tiny model and steps as train_stagefs.py, fed the usual way: torchvision's
ImageFolder over the raw image folder (decoding and resizing every JPEG/PNG in DataLoader
worker processes, every epoch) and a DataLoader.

    python examples/train_imagefolder.py $SCRATCH/data/images/train --steps 20 --image-size 64

Samples, classes and labels follow the same rules as the mount's view (ImageFolder's), so the
two scripts train on the same data; a corrupt image becomes a black one here, as its slot in
the view reads as zeros.
"""

import argparse
import time

import torch
import torchvision
from PIL import Image
from torchvision import transforms

from train_stagefs import tiny_model


def tolerant_loader(path):
    try:
        with open(path, "rb") as f:
            return Image.open(f).convert("RGB")
    except Exception as e:  # a corrupt file must not end the job; the view reads zeros too
        print(f"unreadable image {path}: {e}")
        return Image.new("RGB", (1, 1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", help="an image folder: one subdirectory per class")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    s = args.image_size
    tf = transforms.Compose([
        transforms.Resize(s, antialias=True), transforms.CenterCrop(s), transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    data = torchvision.datasets.ImageFolder(args.folder, transform=tf, loader=tolerant_loader)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, shuffle=True,
                                         num_workers=args.workers, pin_memory=args.device != "cpu")
    model = tiny_model(len(data.classes)).to(args.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step, epoch, start = 0, 0, time.perf_counter()
    while step < args.steps:
        for x, labels in loader:
            x, labels = x.to(args.device, non_blocking=True), labels.to(args.device, non_blocking=True)
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
    print(f"{step} steps in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
