//! The ResNets of the examples and of the launch-budget test (18, 34 and 50 layers): included
//! by path by `examples/resnet.rs` and `tests/launch_budget.rs`.

use mantissa::nn::*;
use mantissa::{Conv2dOptions, Generator, MaxPool2dOptions, Result};

/// What to build: block counts per stage, bottleneck blocks or basic ones, the first stage's
/// width, input channels, classes, and the stem.
pub struct ResNetSpec {
    pub counts: [usize; 4],
    pub bottleneck: bool,
    pub width: usize,
    pub in_channels: usize,
    pub classes: usize,
    /// ImageNet's stem (7x7 stride 2, then a 3x3 max pool); else CIFAR's (a 3x3
    /// convolution, no pool).
    pub imagenet_stem: bool,
    /// Each residual block under gradient checkpointing.
    pub checkpoint: bool,
}

fn conv(i: usize, o: usize, k: usize, stride: usize, g: &mut Generator) -> Result<Conv2d> {
    let opts = Conv2dOptions {
        stride: [stride, stride],
        padding: [k / 2, k / 2],
        ..Default::default()
    };
    Conv2d::new(i, o, k, opts, false, g)
}

/// One block: basic (two 3x3 convolutions) or bottleneck (1x1, 3x3, 1x1 to 4x the width),
/// with a projection shortcut where the shape changes. Returns the block and its output
/// channels.
fn block(
    c_in: usize,
    width: usize,
    stride: usize,
    bottleneck: bool,
    g: &mut Generator,
) -> Result<(Residual, usize)> {
    let (main, c_out) = if bottleneck {
        let c_out = 4 * width;
        let main = Sequential::new()
            .push(conv(c_in, width, 1, 1, g)?)
            .push(BatchNorm2d::new(width)?)
            .push(Activation::Relu)
            .push(conv(width, width, 3, stride, g)?)
            .push(BatchNorm2d::new(width)?)
            .push(Activation::Relu)
            .push(conv(width, c_out, 1, 1, g)?)
            .push(BatchNorm2d::new(c_out)?);
        (main, c_out)
    } else {
        let main = Sequential::new()
            .push(conv(c_in, width, 3, stride, g)?)
            .push(BatchNorm2d::new(width)?)
            .push(Activation::Relu)
            .push(conv(width, width, 3, 1, g)?)
            .push(BatchNorm2d::new(width)?);
        (main, width)
    };
    let shortcut = match stride != 1 || c_in != c_out {
        true => Some(
            Sequential::new()
                .push(conv(c_in, c_out, 1, stride, g)?)
                .push(BatchNorm2d::new(c_out)?),
        ),
        false => None,
    };
    Ok((Residual::new(main, shortcut), c_out))
}

/// The network: a stem, four stages of blocks (widths w, 2w, 4w, 8w; strides 1, 2, 2, 2),
/// global average pooling and a linear classifier.
pub fn resnet(spec: &ResNetSpec, g: &mut Generator) -> Result<Sequential> {
    let (counts, bottleneck, w) = (spec.counts, spec.bottleneck, spec.width);
    let mut net = match spec.imagenet_stem {
        false => Sequential::new().push(conv(spec.in_channels, w, 3, 1, g)?),
        true => Sequential::new().push(conv(spec.in_channels, w, 7, 2, g)?),
    }
    .push(BatchNorm2d::new(w)?)
    .push(Activation::Relu);
    if spec.imagenet_stem {
        let pool = MaxPool2dOptions {
            stride: Some([2, 2]),
            padding: [1, 1],
            ..MaxPool2dOptions::new(3)
        };
        net = net.push(MaxPool2d(pool));
    }
    let mut c = w;
    for (stage, &count) in counts.iter().enumerate() {
        for i in 0..count {
            let stride = if stage > 0 && i == 0 { 2 } else { 1 };
            let (b, c_out) = block(c, w << stage, stride, bottleneck, g)?;
            net = match spec.checkpoint {
                true => net.push(Checkpointed::new(b)),
                false => net.push(b),
            };
            c = c_out;
        }
    }
    Ok(net
        .push(AdaptiveAvgPool2d([1, 1]))
        .push(Flatten)
        .push(Linear::new(c, spec.classes, true, g)?))
}
