package sluice.hadoop;

import java.io.FileNotFoundException;
import java.io.IOException;
import java.net.URI;
import java.net.URISyntaxException;
import java.nio.file.Files;
import java.nio.file.LinkOption;
import java.nio.file.NoSuchFileException;
import java.nio.file.attribute.PosixFileAttributes;
import java.nio.file.attribute.PosixFilePermissions;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.ChecksumFs;
import org.apache.hadoop.fs.FileStatus;
import org.apache.hadoop.fs.DelegateToFileSystem;
import org.apache.hadoop.fs.FsConstants;
import org.apache.hadoop.fs.FsServerDefaults;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RawLocalFileSystem;
import org.apache.hadoop.fs.local.LocalConfigKeys;
import org.apache.hadoop.fs.permission.FsPermission;
import org.apache.hadoop.io.nativeio.NativeIO;

/**
 * The local file system as Spark's checkpoint logs see it (FileContext, scheme "file"), the same
 * as Hadoop's own LocalFs (checksum files included) except for one thing: it sets permissions and
 * reads file status through java.nio instead of starting `chmod`, `readlink` or `ls` processes.
 *
 * Without Hadoop's native library, every file Hadoop creates or renames on the local file system
 * costs several forks of such commands (for the file and its checksum file), and a micro-batch
 * writes two log files: tens of milliseconds per batch on a busy machine. Sluice installs this class for a local Spark
 * (`spark.hadoop.fs.AbstractFileSystem.file.impl`); see sluice.pipeline.jvm.
 */
public class LocalFs extends ChecksumFs {

  public LocalFs(URI uri, Configuration conf) throws IOException, URISyntaxException {
    super(new Raw(uri, conf));
  }

  public LocalFs(Configuration conf) throws IOException, URISyntaxException {
    this(FsConstants.LOCAL_FS_URI, conf);
  }

  /** Hadoop's RawLocalFs over NoForkLocalFileSystem. */
  static final class Raw extends DelegateToFileSystem {
    Raw(URI uri, Configuration conf) throws IOException, URISyntaxException {
      super(uri, new NoForkLocalFileSystem(), conf, FsConstants.LOCAL_FS_URI.getScheme(), false);
    }

    @Override
    public int getUriDefaultPort() {
      return -1;
    }

    @Override
    public FsServerDefaults getServerDefaults(Path f) throws IOException {
      return LocalConfigKeys.getServerDefaults();
    }

    @Override
    @Deprecated
    public FsServerDefaults getServerDefaults() throws IOException {
      return LocalConfigKeys.getServerDefaults();
    }

    @Override
    public boolean isValidName(String src) {
      return true;
    }
  }

  /**
   * RawLocalFileSystem without child processes: permissions are set, and file status (with its
   * owner, group and permissions, and a link's target) is read, through java.nio.
   */
  public static final class NoForkLocalFileSystem extends RawLocalFileSystem {
    @Override
    public FileStatus getFileStatus(Path f) throws IOException {
      return status(f, true);
    }

    @Override
    public FileStatus getFileLinkStatus(Path f) throws IOException {
      return status(f, false);
    }

    private FileStatus status(Path f, boolean follow) throws IOException {
      java.nio.file.Path p = pathToFile(f).toPath();
      PosixFileAttributes a;
      try {
        a = follow
            ? Files.readAttributes(p, PosixFileAttributes.class)
            : Files.readAttributes(p, PosixFileAttributes.class, LinkOption.NOFOLLOW_LINKS);
      } catch (NoSuchFileException e) {
        throw new FileNotFoundException("File " + f + " does not exist");
      }
      Path target = a.isSymbolicLink() ? new Path(Files.readSymbolicLink(p).toString()) : null;
      FsPermission perm = FsPermission.valueOf(
          (a.isDirectory() ? "d" : "-") + PosixFilePermissions.toString(a.permissions()));
      return new FileStatus(a.size(), a.isDirectory(), 1, getDefaultBlockSize(f),
          a.lastModifiedTime().toMillis(), a.lastAccessTime().toMillis(), perm,
          a.owner().getName(), a.group().getName(), target,
          f.makeQualified(getUri(), getWorkingDirectory()));
    }

    @Override
    public void setPermission(Path p, FsPermission permission) throws IOException {
      if (NativeIO.isAvailable() || permission.getStickyBit()) {
        super.setPermission(p, permission);
        return;
      }
      String rwx = permission.getUserAction().SYMBOL + permission.getGroupAction().SYMBOL
          + permission.getOtherAction().SYMBOL;
      Files.setPosixFilePermissions(pathToFile(p).toPath(), PosixFilePermissions.fromString(rwx));
    }
  }
}
