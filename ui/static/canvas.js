// Line charts on a canvas, drawn by hand: the dashboard's charts and the comparison page's.

/** Sizes `canvas` to its box in device pixels; its 2D context (unscaled) and the pixel ratio. */
export function fitCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = Math.round(canvas.clientWidth * ratio) || 300;
  const height = Math.round(canvas.clientHeight * ratio) || 110;
  if (canvas.width !== width || canvas.height !== height) {
    canvas.width = width;
    canvas.height = height;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(1, 0, 0, 1, 0, 0);
  return { ctx, ratio };
}

/** Grid lines at half and all of `top`, labelled with `format`. */
export function drawGrid(ctx, ratio, top, format) {
  const { width, height } = ctx.canvas;
  ctx.strokeStyle = "#eceff2";
  ctx.fillStyle = "#8a949e";
  ctx.lineWidth = 1;
  ctx.font = `${10 * ratio}px system-ui, sans-serif`;
  for (const f of [0.5, 1]) {
    const gy = height - 4 - f * (height - 16);
    ctx.beginPath();
    ctx.moveTo(0, gy);
    ctx.lineTo(width, gy);
    ctx.stroke();
    ctx.fillText(format(top * f), 2, gy - 2);
  }
}

/** One series through `points` at (x(point), y(value)), broken where `key` has no value;
 * `width` in CSS pixels. */
export function drawLine(ctx, ratio, points, { key, color, dashed, width }, x, y) {
  ctx.strokeStyle = color;
  ctx.lineWidth = width * ratio;
  ctx.setLineDash(dashed ? [4 * ratio, 3 * ratio] : []);
  ctx.beginPath();
  let pen = false;
  for (const p of points) {
    const v = p[key];
    if (v === null || v === undefined) {
      pen = false;
      continue;
    }
    if (pen) ctx.lineTo(x(p), y(v));
    else ctx.moveTo(x(p), y(v));
    pen = true;
  }
  ctx.stroke();
  ctx.setLineDash([]);
}
