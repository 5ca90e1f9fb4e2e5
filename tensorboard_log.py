"""--tensorboard: every logged scalar and the pictures also to <output-dir>/tensorboard. harness.setup opens a Writer
for that flag only (it needs the tensorboard package); common.Logger and common.save_image_grid write through it, each
write flushed, so that a run's last records are on disk when it returns. It imports only common.py."""
import os
import re

from common import UserError


class Writer:
    def __init__(self, out):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("--tensorboard needs the tensorboard package (pip install tensorboard), or leave the flag "
                            "out") from None
        self.open = lambda: SummaryWriter(os.path.join(out, "tensorboard"))   # at the first write: after a run
        self._writer = None                                                   # from step 0 moved an old one aside

    @property
    def writer(self):
        self._writer = self._writer or self.open()
        return self._writer

    def scalars(self, rec, step):
        """Every number of a log record but its epoch and step."""
        for k, v in rec.items():
            if isinstance(v, (int, float)) and k not in ("epoch", "step"):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def image(self, path, grid, step):
        """A picture (3, H, W) in [0, 1], tagged by its file's name less the epoch / step part."""
        self.writer.add_image(re.sub(r"_ep\d+.*", "", os.path.basename(path)), grid, step or 0)
        self.writer.flush()
