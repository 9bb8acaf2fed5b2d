"""`python -m expframe.rl.frame_strip`: the frames of one episode, in order, from a frame
replay's arrays; side by side, scaled; a run without a checkpoint is exit 2 with one line."""

import contextlib
import io
import os

import numpy as np

from expframe.rl import frame_strip
from expframe.rl.frame_replay import FrameReplay
from tests.support import TestCase

SHAPE = (4, 4, 3)


def _frame(frame_id):
    return np.full(SHAPE, frame_id, np.uint8)


class FrameStripTest(TestCase):

    def test_the_newest_episode_frames_in_order(self):
        replay = FrameReplay(16, SHAPE, 1, frame_stack=3, n_step=2, discount=0.9)
        frame_id = 0
        for length in (6, 9, 4):   # the ring (16 rows) is overwritten: ids 0-5 and a few more go
            replay.start(0, _frame(frame_id))
            frame_id += 1
            for t in range(length):
                replay.add(0, np.zeros(1), 1.0, 1.0, _frame(frame_id), t == length - 1)
                frame_id += 1
        # Episodes: frames 0-6, 7-16, 17-21 (22 frames); the last transition starts at 20.
        frames = frame_strip.episode_frames(replay.state(), count=10)
        self.assertEqual([int(f[0, 0, 0]) for f in frames], [17, 18, 19, 20])   # its episode's start
        frames = frame_strip.episode_frames(replay.state(), count=3)
        self.assertEqual([int(f[0, 0, 0]) for f in frames], [18, 19, 20])
        image = frame_strip.strip(frames, scale=2, gap=1)
        self.assertEqual(image.shape, (8, 3 * 8 + 2, 3))
        np.testing.assert_array_equal(image[:, 8], 255)                    # the gap
        np.testing.assert_array_equal(image[:, 9:17], 19)                  # the second frame, scaled

    def test_a_run_without_a_checkpoint_is_exit_2(self):
        out = self.get_temp_dir() + "/strip.png"
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = frame_strip.main([self.get_temp_dir(), "--out", out])
        self.assertEqual(code, 2)
        self.assertRegex(err.getvalue().strip(), r"^error: frame_strip: .*/checkpoints holds no checkpoint\.$")
        self.assertFalse(os.path.exists(out))

